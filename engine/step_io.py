"""The step seam: what one engine step hands down to the runner and gets back.

`SchedulerOutput` (with `NewRequestData` / `CachedRequestData`) goes from the
scheduler through the executor and the worker to the model runner;
`ModelRunnerOutput` comes back the same way. This module sits below all of them
(it imports only `SamplingParams`, `TokenLogprobs` and the connector's plain
dataclasses from engine/kv_transfer/metadata.py), so the scheduler and the
workers both depend on it and never on each other.

Runner contract:
- `finished_req_ids` lists every request the runner must forget before this step:
  finished or aborted since the last step, and requests preempted this step (their
  KV is gone; they come back later as a `NewRequestData`).
- A request appears in `scheduled_new_reqs` on its first step after admission
  (first time, or resumed after preemption) with everything the runner needs;
  afterwards in `scheduled_cached_reqs` as a delta.
- `num_computed_tokens` (new and cached) counts the tokens already in the KV cache
  BEFORE this step. The request's query tokens this step are its tokens
  `num_computed_tokens .. num_computed_tokens + num_scheduled_tokens[req_id] - 1`.
  For a running request that sampled a token last step, that token is the input.
- The runner samples for a request only when this step reaches its last known token
  (`num_computed_tokens + num_scheduled == len(token ids)`); a partial prefill
  samples nothing (the scheduler ignores tokens returned for it).

Prefill / decode split (for statistics only; the scheduler has no phases): a
request's scheduled tokens count as decode when it already has output tokens and
this step computes exactly one token, its last one; everything else is prefill
(prompt chunks, and the recompute of a resumed request, outputs included).

With a KV connector, `kv_connector_metadata` carries the step's loads (run before the
forward) and saves (after it), and the runner's output reports the connector's results in
`kv_connector_output`. A step may then have no scheduled tokens and still carry loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from engine.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput
from engine.sampling_params import SamplingParams
from engine.seam import TokenLogprobs


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # All known tokens: prompt + outputs so far (differs from the prompt after a preemption).
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens already in KV (prefix-cache hit).
    num_computed_tokens: int
    # KV cache groups past the first (engine/kv_cache_spec.py), each its own block table; [] with one.
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    # Blocks appended since the last step, per request.
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Tokens in KV before this step, per request. The runner keeps each request's
    # tokens itself (the prompt from `NewRequestData`, then what it sampled).
    num_computed_tokens: list[int] = field(default_factory=list)
    # With several KV cache groups, per request the blocks appended to each group past the first
    # (an empty list: none); empty with one group.
    new_group_block_ids: list[list[list[int]]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (new and cached requests, in batch order).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    # Prefix-cache lookups of this step's admissions, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding (vLLM's name): req_id -> draft tokens scheduled after its last
    # known token. `num_scheduled_tokens` counts them (1 + len(drafts) for a decode); the
    # runner verifies them in this one forward and returns 1..len(drafts)+1 tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured output: req_id -> int32 bitmask row [ceil(vocab / 32)] (bit t of word
    # t // 32 set: token t allowed), for constrained requests that sample this step.
    grammar_bitmask: dict[str, np.ndarray] | None = None
    # The KV connector's loads and saves for this step (None: no connector).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_connector_work(self) -> bool:
        meta = self.kv_connector_metadata
        return meta is not None and not meta.is_empty

    @classmethod
    def empty(cls, finished_req_ids: set[str] | None = None) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, finished_req_ids or set())


@dataclass(slots=True)
class ModelRunnerOutput:
    """Result of one `execute_model` call.

    `req_ids[i]` sampled `sampled_token_ids[i]` (empty when that request is still
    in a partial prefill and sampled nothing this step).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, one entry per sampled token, only for requests that asked.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Wall-clock seconds of the runner's phases this step.
    prepare_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    # How the forward ran (engine/worker/compiled.py): compiled graph or eager, and the
    # token count it computed (the step's tokens padded up to a compiled batch size).
    compiled: bool = False
    padded_tokens: int = 0
    # Seconds this step spent in each kind of collective on rank 0 ("all_reduce", "gather",
    # "broadcast", "dispatch", "combine"); empty with one rank (engine/distributed/parallel_state.py).
    comm_times: dict[str, float] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


# ---- wire format (the multi-process executor sends SchedulerOutput to every rank) --------------
def _enc_hook(obj: Any) -> Any:
    """msgspec cannot encode numpy arrays (grammar bitmasks): dtype, shape and raw bytes."""
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.tobytes()}
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, dict):
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    raise NotImplementedError(f"cannot decode {kind}")


def step_encoder() -> msgspec.msgpack.Encoder:
    """The encoder of step-seam values (numpy arrays included)."""
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def step_decoder(kind: type) -> msgspec.msgpack.Decoder:
    """The decoder of one step-seam type, `step_encoder`'s counterpart."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)
