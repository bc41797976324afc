"""The EngineCore busy loop, run in its own process (or a thread) behind two ZMQ sockets.

Loop: drain the input socket (new requests, aborts, utility calls, shutdown) -> step
while the engine has work -> send the step's EngineCoreOutputs. When idle it blocks on
the input socket, waking once a second to notice a dead parent.

Where the time goes: `LoopStats` splits the loop's wall time into `step()` (the engine:
schedule, forward, sample, update), I/O (draining the input socket, encoding and sending
outputs) and idle waits; it is logged when the loop ends, so a serving run says whether the
engine or the process boundary held it back.

Failure policy:
- an exception inside `engine.step()` finishes every in-flight request with
  `FinishReason.ERROR` and the error text; the loop keeps serving, unless the exception is
  fatal (`ExecutorDiedError`: a tensor-parallel rank died), which then ends the process;
- an exception anywhere else (start-up, socket, abort) is fatal: the process exits
  non-zero and the client's watchdog fails every in-flight request.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from engine import seam as msg
from engine.config import ConfigLimitError, EngineConfig
from engine.hooks import StepHooks
from engine.kernels.kernel_choices import startup_choices
from engine.request import RequestStatus
from engine.seam import EngineCoreOutput, EngineCoreOutputs, FinishReason

logger = logging.getLogger(__name__)

POLL_MS = 1000  # idle wake-up period, to notice a dead parent


def build_engine_core(config: EngineConfig) -> Any:
    """Default engine factory: the real EngineCore (loads the model)."""
    from engine.core.engine_core import EngineCore

    return EngineCore(config)


def default_request_type() -> type:
    from engine.seam import EngineCoreRequest

    return EngineCoreRequest


def engine_stats(engine: Any) -> msg.EngineStats:
    """Snapshot of the scheduler: running, waiting and KV blocks in use."""
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    return msg.EngineStats(
        num_running=int(sched.num_running),
        num_waiting=int(sched.num_waiting),
        kv_blocks_used=int(kv.num_used_blocks),
        kv_blocks_total=int(engine.num_blocks),
        kv_blocks_used_per_group=kv.num_used_blocks_per_group() if kv.other_groups else [],
    )


@dataclass(slots=True)
class LoopStats:
    """Cumulative wall time of the busy loop, by phase (seconds)."""

    steps: int = 0
    step_s: float = 0.0  # inside engine.step()
    io_s: float = 0.0  # draining input (while busy) + encoding and sending outputs
    idle_s: float = 0.0  # blocked on the input socket with nothing to do

    def describe(self) -> str:
        per = 1000.0 / self.steps if self.steps else 0.0
        return (f"{self.steps} steps; step() {self.step_s:.2f} s ({self.step_s * per:.2f} ms/step), "
                f"socket I/O {self.io_s:.3f} s ({self.io_s * per:.3f} ms/step), idle {self.idle_s:.1f} s")


class EngineCoreProc:
    """Owns an engine and the core side of the two sockets; `run()` is the busy loop."""

    def __init__(
        self,
        engine: Any,
        input_addr: str,
        output_addr: str,
        request_type: type,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.engine = engine
        self.ctx = ctx or zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(request_type)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.utility_decoder = msgspec.msgpack.Decoder(msg.UtilityCall)
        self.in_flight: set[str] = set()
        self.stop_event = threading.Event()
        self.loop_stats = LoopStats()

    def send(self, kind: bytes, obj: Any) -> None:
        self.output.send_multipart((kind, self.encoder.encode(obj)), copy=False)

    def run(self, parent_alive: Callable[[], bool] = lambda: True) -> None:
        """Serve until a SHUTDOWN message, `stop_event`, or the parent disappears."""
        clock, stats = time.perf_counter, self.loop_stats
        while not self.stop_event.is_set():
            idle = not self.engine.has_unfinished_requests()
            t0 = clock()
            more = self._drain_input(block=idle)
            if idle:
                stats.idle_s += clock() - t0
            else:
                stats.io_s += clock() - t0
            if not more:
                break
            if idle and not parent_alive():
                logger.warning("engine core: parent process is gone, exiting")
                break
            if idle:  # a rank that died while idle ends the process too (raises ExecutorDiedError)
                getattr(getattr(self.engine, "executor", None), "check_health", lambda: None)()
            if self.engine.has_unfinished_requests():
                self._step()

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close()

    def _drain_input(self, block: bool) -> bool:
        """Handle every queued message; wait up to POLL_MS for the first when `block`.

        Returns False on SHUTDOWN.
        """
        if block and not self.input.poll(POLL_MS):
            return True
        while True:
            try:
                kind, payload = self.input.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return True
            if kind == msg.SHUTDOWN:
                return False
            self._handle(kind, payload)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == msg.ADD:
            request = self.request_decoder.decode(payload)
            self.in_flight.add(request.request_id)
            self.engine.add_request(request)
        elif kind == msg.ABORT:
            ids = self.abort_decoder.decode(payload)
            self.in_flight.difference_update(ids)
            self.engine.abort_requests(ids)
        elif kind == msg.FINISH:  # stop strings: FINISHED_STOPPED, as the offline LLM does
            ids = self.abort_decoder.decode(payload)
            self.in_flight.difference_update(ids)
            self.engine.finish_requests(ids, RequestStatus.FINISHED_STOPPED)
        elif kind == msg.UTILITY:
            self._call_utility(self.utility_decoder.decode(payload))
        else:
            logger.error("engine core: unknown message kind %r ignored", kind)

    def _call_utility(self, call: msg.UtilityCall) -> None:
        result = msg.UtilityResult(call_id=call.call_id)
        try:
            if call.method not in msg.UTILITY_METHODS:
                raise ValueError(f"unknown utility method {call.method!r}")
            if call.method == "get_stats":
                result.result = engine_stats(self.engine)
            elif call.method == "ping":
                result.result = "pong"
            else:
                result.result = getattr(self.engine, call.method)(*call.args)
        except Exception as exc:  # a failed utility call must not end the loop
            result.error = f"{type(exc).__name__}: {exc}"
        self.send(msg.RESULT, result)

    def _step(self) -> None:
        t0 = time.perf_counter()
        fatal: Exception | None = None
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine core: step failed; failing in-flight requests")
            outputs = self._fail_in_flight(exc)
            fatal = exc if getattr(exc, "fatal", False) else None
        t1 = time.perf_counter()
        stats = self.loop_stats
        stats.steps += 1  # counted before the outputs leave: whoever receives them sees this step
        stats.step_s += t1 - t0
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self.in_flight.discard(out.request_id)
        if outputs.outputs or outputs.stats is not None:
            self.send(msg.OUTPUTS, outputs)
        stats.io_s += time.perf_counter() - t1
        if fatal is not None:  # the executor lost a rank: no later step can run (engine/executor/base.py)
            raise fatal

    def _fail_in_flight(self, exc: Exception) -> EngineCoreOutputs:
        ids = sorted(self.in_flight)
        self.engine.abort_requests(ids)  # raising here is fatal, by design
        now = time.time()
        text = f"engine step failed: {type(exc).__name__}: {exc}"
        outs = [
            EngineCoreOutput(
                request_id=rid,
                new_token_ids=[],
                finish_reason=int(FinishReason.ERROR),
                finished_time=now,
                error=text,
            )
            for rid in ids
        ]
        return EngineCoreOutputs(outputs=outs, timestamp=now)


def announce_ready(proc: EngineCoreProc) -> None:
    engine = proc.engine
    info = msg.ReadyInfo(
        max_model_len=int(engine.max_model_len), num_blocks=int(engine.num_blocks), pid=os.getpid(),
        compile_time_s=float(getattr(getattr(engine, "executor", None), "compile_time", 0.0)),
        choices=_choices(engine),
    )
    proc.send(msg.READY, info)


def _choices(engine: Any) -> dict[str, str]:
    """The engine's start-up kernel choices; {} for an engine without a config (test doubles), or
    where naming them fails (logged): a report of the choices never stops an engine that runs."""
    config = getattr(engine, "config", None)
    if not isinstance(config, EngineConfig):
        return {}
    try:
        return startup_choices(config)
    except Exception as exc:  # noqa: BLE001
        logger.warning("engine start-up choices not reported: %s", exc)
        return {}


def build_engine(
    config: EngineConfig,
    engine_factory: Callable[[EngineConfig], Any],
    hooks_factory: Callable[[], StepHooks] | None,
) -> Any:
    """Build the engine where the core runs and install its hooks there (the profiler is per thread)."""
    engine = engine_factory(config)
    if hooks_factory is not None:
        engine.set_hooks(hooks_factory())
    return engine


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    engine_factory: Callable[[EngineConfig], Any] = build_engine_core,
    request_type: type | None = None,
    hooks_factory: Callable[[], StepHooks] | None = None,
) -> None:
    """Process entry point: build the engine, say READY (or FAILED), serve, exit.

    Exits with status 1 on a start-up or fatal error; SIGTERM ends the loop cleanly.
    """
    import multiprocessing

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    if not logging.getLogger().handlers:  # a spawned process starts without the parent's logging set-up
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = multiprocessing.parent_process()
    ctx = zmq.Context()
    proc: EngineCoreProc | None = None
    try:
        engine = build_engine(config, engine_factory, hooks_factory)
        proc = EngineCoreProc(engine, input_addr, output_addr, request_type or default_request_type(), ctx)
        signal.signal(signal.SIGTERM, lambda *_: proc.stop_event.set() if proc else None)
        announce_ready(proc)
        proc.run(parent_alive=(lambda: parent.is_alive()) if parent else (lambda: True))
        logger.info("engine core loop: %s", proc.loop_stats.describe())
        engine.shutdown()
    except Exception as exc:
        if isinstance(exc, ConfigLimitError):  # a setting to change, not a bug: one line, no traceback
            logger.error("engine core: %s", exc)
        else:
            logger.exception("engine core: fatal error")
        _report_failure(ctx, output_addr, proc, exc)
        ctx.term()  # waits for the FAILED message to leave (linger)
        os._exit(1)
    if proc is not None:
        proc.close()
    ctx.term()


def _report_failure(ctx: zmq.Context, output_addr: str, proc: EngineCoreProc | None, exc: Exception) -> None:
    text = f"{type(exc).__name__}: {exc}"
    if proc is not None:
        proc.send(msg.FAILED, text)
        proc.input.close(linger=0)
        proc.output.close(linger=1000)
        return
    sock = ctx.socket(zmq.PUSH)
    sock.connect(output_addr)
    sock.send_multipart((msg.FAILED, msgspec.msgpack.encode(text)))
    sock.close(linger=1000)
