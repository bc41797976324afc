"""Wire format between the multi-process executor and its worker processes (ZMQ, msgspec).

The executor binds one ROUTER socket; each worker connects a DEALER whose identity is its rank
(`identity(rank)`). Every message is `[kind, payload]` (the ROUTER adds the identity frame),
payloads msgpack with typed decoders: nothing is unpickled.

Worker -> executor:
    HELLO   payload: int (the rank), once after connecting
    READY   payload: WorkerReady, once the model is loaded and the KV cache allocated
    OUTPUT  payload: ModelRunnerOutput, rank 0 only, once per step
    ERROR   payload: str, a start-up or step failure (the worker then exits)
Executor -> worker:
    CONFIG   payload: EngineConfig, the answer to HELLO
    STEP     payload: SchedulerOutput, encoded once per step and sent to every rank
    SHUTDOWN payload: empty
"""

from __future__ import annotations

import msgspec

HELLO = b"h"
READY = b"r"
OUTPUT = b"o"
ERROR = b"e"
CONFIG = b"c"
STEP = b"s"
SHUTDOWN = b"q"


class WorkerReady(msgspec.Struct):
    rank: int
    pid: int
    num_blocks: int
    max_model_len: int
    eos_token_id: int | None
    vocab_size: int
    kv_bytes_per_block: int = 0  # one KV block of the whole model (a connector's scheduler half sizes with it)


def identity(rank: int) -> bytes:
    return f"rank{rank}".encode()
