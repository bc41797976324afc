"""Entry point of one worker process: `python -m engine.distributed.worker_proc`.

The multi-process executor starts one per local rank; on other nodes (multi-node tensor
parallel) start them by hand with torchrun's variables RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set (flags override the first two; docs/distributed.md):

    python -m engine.distributed.worker_proc --executor tcp://node0:5555

The worker connects to the executor, receives the engine config, joins the process group,
loads its slice of the model and then runs every step it is sent until SHUTDOWN, its
executor going silent past the timeout, or (ranks it started) the executor's process exiting.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import msgspec
import zmq

from engine.config import ConfigLimitError, EngineConfig
from engine.distributed import wire
from engine.step_io import SchedulerOutput, step_decoder, step_encoder

logger = logging.getLogger("engine.distributed.worker_proc")
POLL_MS = 1000


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it exits (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def serve(rank: int, local_rank: int, executor_addr: str, watch_parent: bool) -> int:
    from engine.distributed.worker import ParallelWorker

    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, wire.identity(rank))
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(executor_addr)
    sock.send_multipart((wire.HELLO, msgspec.msgpack.encode(rank)))
    worker: ParallelWorker | None = None
    decoder = step_decoder(SchedulerOutput)
    encoder = step_encoder()
    try:
        while True:
            if not sock.poll(POLL_MS):
                if watch_parent and os.getppid() != parent:
                    return 1
                continue
            kind, payload = sock.recv_multipart()
            if kind == wire.SHUTDOWN:
                return 0
            if kind == wire.CONFIG:
                config = msgspec.msgpack.decode(payload, type=EngineConfig)
                worker = ParallelWorker(config, rank, local_rank)
                num_blocks = worker.load_and_allocate()
                ready = wire.WorkerReady(rank, os.getpid(), num_blocks, worker.max_model_len,
                                         worker.arch.eos_token_id, worker.arch.vocab_size, worker.kv_bytes_per_block)
                sock.send_multipart((wire.READY, encoder.encode(ready)))
            elif kind == wire.STEP:
                assert worker is not None, "STEP before CONFIG"
                out = worker.execute_model(decoder.decode(payload))
                if rank == 0:
                    sock.send_multipart((wire.OUTPUT, encoder.encode(out)))
    except Exception as exc:
        if isinstance(exc, ConfigLimitError):  # a setting to change, not a bug: one line, no traceback
            logger.error("worker rank %d: %s", rank, exc)
            name = "ValueError"  # the executor re-raises a start-up ValueError as the user's error
        else:
            logger.exception("worker rank %d failed", rank)
            name = type(exc).__name__
        sock.send_multipart((wire.ERROR, encoder.encode(f"{name}: {exc}")))
        return 1
    finally:
        # No destroy_process_group: with a peer already gone it can wait; the process exit frees the group.
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="servelab tensor-parallel worker (one rank)")
    p.add_argument("--executor", required=True, help="the executor's address, e.g. tcp://node0:5555")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "-1")))
    p.add_argument("--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    p.add_argument("--watch-parent", action="store_true", help="exit with the process that started this one")
    args = p.parse_args(argv)
    if args.rank < 0:
        p.error("--rank (or RANK) is required")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            p.error(f"{var} must be set (env:// rendezvous)")
    if args.watch_parent:
        _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when ranks stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    code = serve(args.rank, args.local_rank, args.executor, args.watch_parent)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: with the process group still up (a peer may be gone, so it
    # is never destroyed) it can wait seconds on gloo's threads; the socket is already closed.
    os._exit(code)


if __name__ == "__main__":
    main()
