"""The seam between the front end and the EngineCore process: every type that crosses it, and
its wire format.

Types: `EngineCoreRequest` (front end -> core: a tokenized, validated request), `EngineCoreOutputs`
of `EngineCoreOutput` (core -> front end: new token ids, finish state, timestamps, the step's
`StepStats`), `FinishReason`, and the control messages below. Plain msgspec structs: nothing that
crosses is pickled. Both processes import this module; neither side's internals.

Every message is a ZMQ multipart message `[kind, payload]`: `kind` is one byte naming
the message type, `payload` is msgspec msgpack. Decoders are typed, so nothing that
arrives over a socket is ever unpickled or turned into an arbitrary object.

Front end -> core (input socket):
    ADD      payload: EngineCoreRequest
    ABORT    payload: list[str] (request ids): the client gave up on them
    FINISH   payload: list[str] (request ids): a stop string ended them on the front end
    UTILITY  payload: UtilityCall
    SHUTDOWN payload: empty

Core -> front end (output socket):
    READY    payload: ReadyInfo, sent once after the model loaded
    FAILED   payload: str, the start-up error (the process then exits)
    OUTPUTS  payload: EngineCoreOutputs
    RESULT   payload: UtilityResult
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams

# Input kinds.
ADD = b"a"
ABORT = b"x"
FINISH = b"f"
UTILITY = b"u"
SHUTDOWN = b"q"

# Output kinds.
READY = b"R"
FAILED = b"F"
OUTPUTS = b"O"
RESULT = b"U"

# Utility methods the core answers; anything else is refused.
UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache", "ping"})


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class ReadyInfo(msgspec.Struct):
    """What the front end learns from the core once the model is loaded."""

    max_model_len: int
    num_blocks: int
    pid: int
    compile_time_s: float = 0.0  # start-up compile + warm-up of the forward (enforce_eager=False)
    # the kernels the core chose at start-up (engine/kernels/kernel_choices.py), logged by the front end
    choices: dict[str, str] = msgspec.field(default_factory=dict)


class EngineStats(msgspec.Struct):
    """A snapshot of the scheduler's state, answered to the `get_stats` utility call."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used_per_group: list[int] = []  # several KV cache groups: blocks each holds

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """A tokenized, validated request as it crosses into the core (front end -> core)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, stop token or stop string
    LENGTH = 1  # max_tokens or the context length
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


def finish_reason_str(value: int | None) -> str | None:
    """A FinishReason value as its name ("stop", "length", ...), None for None."""
    return None if value is None else str(FinishReason(value))


# One position's logprobs: (sampled token id, its logprob, [(top id, top logprob), ...]).
TokenLogprobs = tuple[int, float, list[tuple[int, float]]]


class StepMember(msgspec.Struct, array_like=True, frozen=True):
    """One request's part in a step (step_members.csv; SLO attribution, analysis/attribution.py).

    `kind`: "decode" (exactly its next token, its prompt computed), "recompute" (a request
    back from preemption recomputing what it had: its first step after resuming and every
    chunk until it samples), "prefill" otherwise. `num_computed` is its tokens in KV before
    the step; `num_prefix_hit` the tokens its admission found cached (0 on later steps)."""

    request_id: str
    num_tokens: int  # scheduled this step (drafts included)
    kind: str
    num_computed: int = 0
    num_prefix_hit: int = 0


class StepStats(msgspec.Struct, omit_defaults=False):
    """Engine state after one step: what the workbench records into steps.csv."""

    step: int
    time: float  # time.time() at the end of the step
    schedule_time: float = 0.0
    prepare_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    update_time: float = 0.0
    step_time: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # With several KV cache groups (engine/kv_cache_spec.py: a model with sliding-window layers),
    # the blocks each group holds, group 0 (full attention) first; their sum is kv_blocks_used.
    # Empty with one group.
    kv_blocks_used_per_group: list[int] = []
    prefix_cache_queries: int = 0  # tokens queried this step
    prefix_cache_hits: int = 0  # tokens hit this step
    num_preemptions: int = 0  # this step
    num_finished: int = 0
    num_kv_tokens_read: int = 0  # sum of num_computed_tokens of the scheduled requests before the step
    num_drafts: int = 0  # requests verified with draft tokens this step (vLLM's spec_decode_num_drafts)
    num_draft_tokens: int = 0  # speculative drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted (acceptance rate = accepted / drafts)
    num_accepted_tokens_per_pos: list[int] = []  # accepted drafts by position in the draft, this step
    compiled: bool = False  # the forward ran a compiled graph (enforce_eager=False)
    padded_tokens: int = 0  # tokens the forward computed: the step's tokens padded to the graph's batch size
    # Steps in flight once this one was submitted, itself included: 1 without async
    # scheduling; 2 when it was scheduled while the previous step ran.
    batch_queue_depth: int = 1
    # Seconds of collectives on rank 0 this step (tensor / expert parallel; 0 with one rank):
    # all of them, and the all-reduces (after attention and MLP, the embedding), the MoE
    # dispatch and combine among them (engine/distributed/parallel_state.py).
    comm_time: float = 0.0
    all_reduce_time: float = 0.0
    dispatch_time: float = 0.0
    combine_time: float = 0.0
    # KV connector (engine/kv_transfer/), this step; see engine/core/sched/stats.py.
    kv_blocks_to_load: int = 0
    kv_blocks_to_save: int = 0
    kv_blocks_loaded: int = 0
    kv_blocks_saved: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    kv_load_time: float = 0.0
    kv_save_time: float = 0.0
    kv_external_hit_tokens: int = 0
    kv_load_failures: int = 0
    members: list[StepMember] = []  # the requests this step ran (not a steps.csv column)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None  # FinishReason value
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    num_cached_tokens: int = 0
    # Timestamps (time.time()) filled when they happen; 0.0 = not yet.
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    error: str | None = None
    # Speculative decoding totals of the request so far: drafts verified, drafts accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # External KV (engine/kv_transfer/): prompt tokens loaded from a store (part of
    # num_cached_tokens), bytes moved each way, seconds waiting for loads / saving.
    num_external_cached_tokens: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    kv_load_wait: float = 0.0
    kv_save_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: StepStats | None = None
    timestamp: float = 0.0  # time.time() when the step that produced these ended
