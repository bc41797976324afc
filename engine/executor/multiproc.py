"""The multi-process executor (`distributed_executor_backend="mp"`, vLLM's MultiprocExecutor shape).

One worker process per tensor-parallel rank (`engine/distributed/worker_proc.py`), started and
watched by this executor inside the EngineCore's process. Per step the SchedulerOutput is
encoded once (msgspec) and sent to every rank over one ZMQ ROUTER socket; the ranks run the
step together (their collectives go through torch.distributed, not through here) and rank 0
answers with the ModelRunnerOutput (engine/distributed/wire.py states the protocol).

Failure: while it waits, the executor polls its socket every POLL_MS and checks that every
rank it started is alive. A dead rank, or a rank's ERROR, raises `ExecutorDiedError` at once
(the in-flight step's requests fail with it); the executor then kills the remaining ranks, and
every later call raises the same error: the engine cannot run without a rank. Workers die with
this process (PR_SET_PDEATHSIG) and exit when it goes silent.

Multi-node (`ParallelConfig.nnodes > 1`): this executor starts ranks 0 .. tp/nnodes - 1 and
waits for the others, started on their nodes with `python -m engine.distributed.worker_proc
--executor tcp://<master_addr>:<master_port + 1>` under torchrun's environment variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); only local ranks are watched for death (remote ones surface through
rank 0's failing collective or the worker timeout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import weakref

import msgspec
import zmq

from engine.config import EngineConfig
from engine.distributed import wire
from engine.distributed.netif import free_port
from engine.executor.base import Executor, ExecutorDiedError
from engine.step_io import ModelRunnerOutput, SchedulerOutput, step_decoder, step_encoder

logger = logging.getLogger(__name__)

POLL_MS = 50
STARTUP_TIMEOUT_S = 600.0
CONFIG_ERROR = "ValueError: "  # a worker's start-up ValueError is a config error, re-raised as one


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        par = config.parallel
        self.world_size = par.tensor_parallel_size
        self.local_ranks = range(self.world_size // par.nnodes)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank fails, not drops
        # An executor dropped without shutdown() (an LLM that goes out of scope) must not leave its
        # context to the garbage collector: collected in one cycle with its socket, the context's
        # term() waits forever for a socket the collector has not closed yet. The finalizer holds
        # them (and the rank processes) until it has closed, terminated and killed them.
        self._finalizer = weakref.finalize(self, _release, self._sock, self._ctx, self.procs)
        if par.nnodes > 1:  # a known port the other nodes' ranks connect to
            self.port = par.master_port + 1
            self._sock.bind(f"tcp://{par.master_addr}:{self.port}")
            self.address = f"tcp://{par.master_addr}:{self.port}"
        else:
            self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{self.port}"
        self._dead: str | None = None
        self._starting = True
        self._decoder = step_decoder(ModelRunnerOutput)
        self._encoder = step_encoder()

    # ---- start-up --------------------------------------------------------------------
    def initialize(self) -> int:
        par = self.config.parallel
        master_port = par.master_port or free_port(par.master_addr)
        env = dict(os.environ, MASTER_ADDR=par.master_addr, MASTER_PORT=str(master_port),
                   WORLD_SIZE=str(self.world_size))
        if par.nnodes > 1:
            logger.info("multi-node: start ranks %d..%d on the other nodes with MASTER_ADDR=%s MASTER_PORT=%d "
                        "python -m engine.distributed.worker_proc --executor %s", len(self.local_ranks),
                        self.world_size - 1, par.master_addr, master_port, self.address)
        for rank in self.local_ranks:
            cmd = [sys.executable, "-m", "engine.distributed.worker_proc", "--executor", self.address,
                   "--rank", str(rank), "--local-rank", str(rank), "--watch-parent"]
            self.procs[rank] = subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))
        try:
            readies = self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._starting = False
        first = readies[0]
        self.max_model_len, self.eos_token_id, self.vocab_size = first.max_model_len, first.eos_token_id, \
            first.vocab_size
        self.kv_bytes_per_block = first.kv_bytes_per_block  # the scheduler half of a KV connector sizes with it
        logger.info("multi-process executor: %d ranks (pids %s), %d KV blocks each", self.world_size,
                    [r.pid for r in readies], first.num_blocks)
        return first.num_blocks

    def _start_workers(self) -> list[wire.WorkerReady]:
        config = self._encoder.encode(self.config)
        readies: dict[int, wire.WorkerReady] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(readies) < self.world_size:
            if time.monotonic() > deadline:
                raise ExecutorDiedError(f"workers not ready after {STARTUP_TIMEOUT_S:.0f} s "
                                        f"({len(readies)}/{self.world_size} ranks)")
            rank, kind, payload = self._recv()
            if kind == wire.HELLO:
                self._sock.send_multipart((wire.identity(rank), wire.CONFIG, config))
            elif kind == wire.READY:
                readies[rank] = msgspec.msgpack.decode(payload, type=wire.WorkerReady)
        return [readies[r] for r in range(self.world_size)]

    # ---- steps -----------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise ExecutorDiedError(self._dead)
        payload = self._encoder.encode(scheduler_output)  # once, for every rank
        try:
            for rank in range(self.world_size):
                self._sock.send_multipart((wire.identity(rank), wire.STEP, payload))
        except zmq.ZMQError as exc:
            self._fail(f"cannot reach a worker: {exc}")
        while True:
            rank, kind, payload = self._recv(self.config.parallel.worker_timeout_s)
            if kind == wire.OUTPUT:
                return self._decoder.decode(payload)

    def _recv(self, timeout_s: float = STARTUP_TIMEOUT_S) -> tuple[int, bytes, bytes]:
        """The next message (rank, kind, payload); ExecutorDiedError on a dead or failing rank."""
        deadline = time.monotonic() + timeout_s
        while not self._sock.poll(POLL_MS):
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(f"no answer from the workers in {timeout_s:.0f} s")
        ident, kind, payload = self._sock.recv_multipart()
        rank = int(ident.decode().removeprefix("rank"))
        if kind == wire.ERROR:
            error = msgspec.msgpack.decode(payload, type=str)
            if self._starting and error.startswith(CONFIG_ERROR):
                # a setting the model cannot run with (e.g. heads that do not split): the user's error
                self._dead = error
                self._kill_workers()
                raise ValueError(error.removeprefix(CONFIG_ERROR))
            time.sleep(POLL_MS / 1000)  # a rank failing in a collective: name the dead peer, if one died
            self._check_alive()
            self._fail(f"worker rank {rank} failed: {error}")
        return rank, kind, payload

    def _check_alive(self) -> None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and not self._sock.poll(0):  # a rank's last message (its ERROR) is read first
                self._fail(f"worker rank {rank} (pid {proc.pid}) died with exit code {code}")

    def _fail(self, reason: str) -> None:
        self._dead = reason
        logger.error("multi-process executor: %s; stopping every rank", reason)
        self._kill_workers()
        raise ExecutorDiedError(reason)

    # ---- shutdown --------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._dead is None and not self._sock.closed:
            for rank in range(self.world_size):  # other nodes' ranks too
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart((wire.identity(rank), wire.SHUTDOWN, b""), flags=zmq.NOBLOCK)
        self._kill_workers(grace_s=5.0)
        self._finalizer()

    def _kill_workers(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def check_health(self) -> None:
        if self._dead is not None:
            raise ExecutorDiedError(self._dead)
        self._check_alive()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]


def _release(sock: zmq.Socket, ctx: zmq.Context, procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """Close the executor's socket and context and kill its ranks (shutdown(), or the finalizer)."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not sock.closed:
        sock.close(linger=0)
    if not ctx.closed:
        ctx.term()
