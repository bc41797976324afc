"""Front-end side of the EngineCore: send requests and aborts, receive outputs.

`EngineCoreClient` starts the core (a spawned process, or a thread of this process for
the in-process target), waits for its READY handshake, then runs two background tasks
on the caller's event loop:
- the output reader decodes `EngineCoreOutputs` and hands them to `on_outputs`;
- the watchdog checks every WATCH_S that the core is alive; when it is not, the client
  turns unhealthy and `on_dead(EngineDeadError)` is called once, so every in-flight
  request can fail at once.

Sends use a plain (non-asyncio) PUSH socket with no high-water mark, so `add_request`,
`abort_requests` and `finish_requests` never block and may be called from `finally:` blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine import seam as msg
from engine.config import ConfigLimitError, EngineConfig
from engine.core.core_proc import (
    EngineCoreProc,
    announce_ready,
    build_engine,
    build_engine_core,
    run_engine_core,
)
from engine.hooks import StepHooks
from engine.seam import EngineCoreOutputs

logger = logging.getLogger(__name__)

WATCH_S = 0.05


class EngineDeadError(RuntimeError):
    """The EngineCore process (or thread) is gone; no request can complete."""


class EngineStartError(RuntimeError):
    """The EngineCore failed to load or did not report ready in time."""


class EngineCoreClient:
    """Async client of one EngineCore. Create with `await EngineCoreClient.start(...)`."""

    def __init__(self, config: EngineConfig, multiprocess: bool) -> None:
        self.config = config
        self.multiprocess = multiprocess
        self._tmpdir = tempfile.mkdtemp(prefix="servelab-core-")
        self.input_addr = f"ipc://{self._tmpdir}/input"
        self.output_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self.input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self.output_addr)
        self._aoutput: zmq.asyncio.Socket | None = None  # async view, made on the serving loop
        # Never leave the context to the garbage collector with its sockets (see multiproc.py),
        # nor the sockets' folder behind a client that was dropped without shutdown().
        self._finalizer = weakref.finalize(self, _release_ipc, self._input, self._output, self._ctx, self._tmpdir)
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._result_decoder = msgspec.msgpack.Decoder(msg.UtilityResult)
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._process: Any = None
        self._thread_core: EngineCoreProc | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: str | None = None  # why the core thread failed to start, for _wait_ready
        self._dead: EngineDeadError | None = None
        self._closed = False
        self.ready: msg.ReadyInfo | None = None
        # Front-end cost per engine step: decoding + output processing (detokenize, stop strings,
        # hand-off to each request's stream), logged at shutdown next to the core's own split.
        self.output_batches = 0
        self.output_s = 0.0
        self.on_outputs: Callable[[EngineCoreOutputs], None] = lambda outputs: None
        self.on_dead: Callable[[EngineDeadError], None] = lambda err: None

    # ---- life cycle -------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        multiprocess: bool = True,
        engine_factory: Callable[[EngineConfig], Any] = build_engine_core,
        request_type: type | None = None,
        ready_timeout_s: float = 600.0,
        hooks_factory: Callable[[], StepHooks] | None = None,
    ) -> EngineCoreClient:
        """Start the core and block until it is READY (the model is loaded).

        `engine_factory` (a module-level callable, picklable by reference) builds the
        engine inside the core, then `hooks_factory` (if any; picklable too for a
        process) its observation hooks; raises EngineStartError if it fails or times out.
        The background tasks start on the first `ensure_running()` inside a loop.
        """
        client = cls(config, multiprocess)
        try:
            if multiprocess:
                client._spawn_process(engine_factory, request_type, hooks_factory)
            else:
                client._start_thread(engine_factory, request_type, hooks_factory)
            client._wait_ready(ready_timeout_s)
        except BaseException:
            client.shutdown()
            raise
        return client

    def ensure_running(self) -> None:
        """Start the output reader and the watchdog on the running loop (idempotent)."""
        if self._tasks or self._closed:
            return
        self._aoutput = zmq.asyncio.Socket.shadow(self._output.underlying)
        self._tasks = [
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._watch()),
        ]

    def _spawn_process(
        self, engine_factory: Callable[..., Any], request_type: type | None,
        hooks_factory: Callable[[], StepHooks] | None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(
            target=run_engine_core,
            name="EngineCore",
            args=(self.config, self.input_addr, self.output_addr, engine_factory, request_type, hooks_factory),
            daemon=True,
        )
        self._process.start()

    def _start_thread(
        self, engine_factory: Callable[..., Any], request_type: type | None,
        hooks_factory: Callable[[], StepHooks] | None,
    ) -> None:
        def target() -> None:
            try:
                engine = build_engine(self.config, engine_factory, hooks_factory)
                from engine.core.core_proc import default_request_type

                core = EngineCoreProc(
                    engine, self.input_addr, self.output_addr, request_type or default_request_type()
                )
                self._thread_core = core
                announce_ready(core)
                core.run()
                engine.shutdown()
                core.close()
            except Exception as exc:
                if self._thread_core is None:  # during start-up: _wait_ready reports it
                    self._thread_error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ConfigLimitError):  # a setting to change, not a bug: one line
                    logger.error("engine core thread: %s", exc)
                else:
                    logger.exception("engine core thread: fatal error")

        self._thread = threading.Thread(target=target, name="EngineCore", daemon=True)
        self._thread.start()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = self._core_alive()  # read before polling: a FAILED message precedes the exit
            if self._output.poll(int(WATCH_S * 1000)):
                kind, payload = self._output.recv_multipart()
                if kind == msg.READY:
                    self.ready = msgspec.msgpack.decode(payload, type=msg.ReadyInfo)
                    return
                if kind == msg.FAILED:
                    raise EngineStartError(f"engine core failed to start: {msgspec.msgpack.decode(payload)}")
            elif not alive:
                if self._thread_error is not None:
                    raise EngineStartError(f"engine core failed to start: {self._thread_error}")
                raise EngineStartError("engine core exited during start-up")
        raise EngineStartError(f"engine core not ready after {timeout_s:.0f} s")

    def _core_alive(self) -> bool:
        if self._process is not None:
            return bool(self._process.is_alive())
        return self._thread is not None and self._thread.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_healthy(self) -> bool:
        return self._dead is None and not self._closed

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop, wait up to `timeout_s`, then terminate it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.output_batches:
            logger.info("engine client: %d output batches, decode + output processing %.2f s (%.3f ms/batch)",
                        self.output_batches, self.output_s, 1000 * self.output_s / self.output_batches)
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self._input.send_multipart((msg.SHUTDOWN, b""), flags=zmq.NOBLOCK)
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(2.0)
        if self._thread is not None:
            if self._thread_core is not None:
                self._thread_core.stop_event.set()
            self._thread.join(timeout_s)
        self._fail_pending_calls(EngineDeadError("engine core shut down"))
        self._finalizer()

    # ---- requests ---------------------------------------------------------------

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("engine core shut down")
        self._input.send_multipart((kind, payload), flags=zmq.NOBLOCK, copy=False)

    def add_request(self, request: Any) -> None:
        """Queue an EngineCoreRequest in the core; raises EngineDeadError if it is gone."""
        self._send(msg.ADD, self._encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in the core; a no-op once the core is gone (nothing left to free), or going: a core
        exiting on a fatal step error has no peer socket left, and the send would fail with Again."""
        if request_ids and self.is_healthy():
            with contextlib.suppress(zmq.Again):
                self._send(msg.ABORT, self._encoder.encode(request_ids))

    def finish_requests(self, request_ids: list[str]) -> None:
        """Finish as stopped in the core (a stop string found on the front end); a no-op once it is gone."""
        if request_ids and self.is_healthy():
            with contextlib.suppress(zmq.Again):
                self._send(msg.FINISH, self._encoder.encode(request_ids))

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 5.0) -> Any:
        """Run a utility method (see seam.UTILITY_METHODS) in the core between steps."""
        self.ensure_running()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        try:
            self._send(msg.UTILITY, self._encoder.encode(msg.UtilityCall(call_id, method, list(args))))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending_calls.pop(call_id, None)

    async def get_stats(self) -> msg.EngineStats:
        raw = await self.call_utility("get_stats")
        return msgspec.convert(raw, msg.EngineStats)

    # ---- background tasks ---------------------------------------------------------

    async def _read_outputs(self) -> None:
        assert self._aoutput is not None
        while True:
            kind, payload = await self._aoutput.recv_multipart()
            try:
                self._dispatch(kind, payload)
            except Exception:
                logger.exception("engine client: failed to dispatch a %r message", kind)

    def _dispatch(self, kind: bytes, payload: bytes) -> None:
        if kind == msg.OUTPUTS:
            t0 = time.perf_counter()
            self.on_outputs(self._outputs_decoder.decode(payload))
            self.output_batches += 1
            self.output_s += time.perf_counter() - t0
        elif kind == msg.RESULT:
            res = self._result_decoder.decode(payload)
            fut = self._pending_calls.get(res.call_id)
            if fut is not None and not fut.done():
                if res.error is not None:
                    fut.set_exception(RuntimeError(res.error))
                else:
                    fut.set_result(res.result)
        elif kind == msg.FAILED:
            logger.error("engine core reported a fatal error: %s", msgspec.msgpack.decode(payload))

    async def _watch(self) -> None:
        while self._core_alive():
            await asyncio.sleep(WATCH_S)
        if self._closed:
            return
        code = self._process.exitcode if self._process is not None else None
        self._dead = EngineDeadError(
            "engine core process died" + (f" (exit code {code})" if code is not None else "")
        )
        logger.error("%s", self._dead)
        self._fail_pending_calls(self._dead)
        self.on_dead(self._dead)

    def _fail_pending_calls(self, err: Exception) -> None:
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(err)


def _release_ipc(inp: zmq.Socket, out: zmq.Socket, ctx: zmq.Context, folder: str) -> None:
    for sock in (inp, out):
        if not sock.closed:
            sock.close(linger=0)
    if not ctx.closed:
        ctx.term()
    shutil.rmtree(folder, ignore_errors=True)
