"""Wire format between the front end and the EngineCore process.

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

from typing import Any

import msgspec

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

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
