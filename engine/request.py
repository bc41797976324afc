"""The request state machine.

    WAITING ──schedule──▶ RUNNING ──stop/length──▶ FINISHED_*
       ▲                     │
       └──── PREEMPTED ◀─────┘  (KV freed, recomputed from token 0 on resume)

Any unfinished state may also go to FINISHED_ABORTED / FINISHED_ERROR.

With a KV connector (engine/kv_transfer/), a waiting request whose prefix an external store
holds goes WAITING ──▶ WAITING_FOR_REMOTE_KVS (it holds its blocks while they load, and is
not scheduled) ──load done or failed──▶ WAITING, then is admitted with the loaded tokens
computed (a failed load: only its local prefix hit).

`num_computed_tokens` is the only progress counter: the number of this request's
tokens whose KV is (or, once the scheduled step runs, will be) in the cache.
"Prefill" and "decode" are derived from it, never stored: a request is catching
up while `num_computed_tokens < num_tokens - 1`.

With async scheduling (`SchedulerConfig.async_scheduling`) a step may be scheduled
before the previous step's sampled token is known: `num_output_placeholders` counts
the tokens a scheduled step will sample but whose ids have not arrived yet, so
`num_computed_tokens` may run up to `num_tokens + num_output_placeholders`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

from engine.sampling_params import SamplingParams
from engine.seam import FinishReason

# A block hash as produced by engine.core.kv_cache.hashing (a sha256 digest).
BlockHash = bytes
# Computes the hashes of the request's full blocks that `request.block_hashes` lacks.
BlockHasher = Callable[["Request"], list[BlockHash]]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    WAITING_FOR_REMOTE_KVS = 7


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def is_finished(status: RequestStatus) -> bool:
    return RequestStatus.FINISHED_STOPPED <= status <= RequestStatus.FINISHED_ERROR


def finish_reason(status: RequestStatus) -> FinishReason:
    """The FinishReason of a finished status; ValueError for an unfinished one."""
    try:
        return _FINISH_REASONS[status]
    except KeyError:
        raise ValueError(f"{status.name} is not a finished status") from None


class Request:
    """One sequence being served (n > 1 is expanded into n requests by the front end).

    `max_tokens` is the resolved output limit (None: only max_model_len limits it).
    `block_hasher`, when set (the scheduler sets it when prefix caching is on), keeps
    `block_hashes` equal to the hashes of every full block of `all_token_ids`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.max_tokens = sampling_params.max_tokens if max_tokens is None else max_tokens

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps in flight whose ids are not known yet (async scheduling).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 before
        # Speculative decoding: draft tokens proposed for the next step (engine/spec_decode/),
        # and this request's totals of drafts scheduled and accepted.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_preemptions = 0
        # External KV (engine/kv_transfer/): tokens loaded from a store at admission, bytes
        # moved each way, seconds spent waiting for loads and saving.
        self.num_external_cached_tokens = 0
        self.kv_bytes_loaded = 0
        self.kv_bytes_saved = 0
        self.kv_load_wait = 0.0
        self.kv_save_time = 0.0
        self.stop_reason: int | str | None = None
        self.error: str | None = None

        self.first_scheduled_time = 0.0
        self.first_token_time = 0.0
        self.finished_time = 0.0

        self.block_hashes: list[BlockHash] = []
        self._block_hasher: BlockHasher | None = None
        self._hash_block_size = 1
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    def set_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Attach the hasher and hash every full block known so far."""
        self._block_hasher = block_hasher
        # Tokens per hashed block, when the hasher says (`make_block_hasher` does): a new
        # token then calls the hasher only when it completes a block.
        self._hash_block_size = int(getattr(block_hasher, "block_size", 1))
        self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus the draft tokens proposed for the next step (vLLM's name)."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens; block hashes follow when a block becomes full."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            ids = list(token_ids)
            self.output_token_ids.extend(ids)
            self.all_token_ids.extend(ids)
        hasher = self._block_hasher
        next_full = (len(self.block_hashes) + 1) * self._hash_block_size
        if hasher is not None and len(self.all_token_ids) >= next_full:
            self.block_hashes.extend(hasher(self))

    def get_finish_reason(self) -> FinishReason | None:
        return finish_reason(self.status) if self.is_finished else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens}"
            f"{f'+{self.num_output_placeholders}?' if self.num_output_placeholders else ''})"
        )
