"""Simulated runs: the engine's own EngineCore and scheduler on a `SimulatedExecutor`'s virtual clock.

`simulate(specs, engine_config, executor)` replays a workload as a discrete-event loop:
requests whose send time has come (on the virtual clock) are added to the engine; while the
engine has work it steps (each step advances the clock by the modelled step time); when it
is idle the clock jumps to the next send time. It returns the same `RequestRecord`s the real
driver produces (times in seconds since the run start, one time per output token: the end of
the step that produced it), so `analysis.metrics.summarize`, the run folder and the reports
work unchanged.

Send times follow the driver's rules, from the same `SendSchedule`
(`workloads/send_schedule.py`): open loop sends each spec at `arrival_s` (with `concurrency`,
a spec waits for a free slot); closed loop (`closed_loop=True`) keeps `concurrency` users,
each sending its next spec when its previous one finished; a finished spec's `follow_up`
(multi-turn) is sent at the follow-up's `arrival_s`. There is no client or network: lateness
is 0 and TTFT is measured from the send.

Prompt tokens: `spec.prompt_token_ids` when present (their values matter for prefix
caching); otherwise `tokenize(spec.prompt)` when a tokenizer is given; otherwise
`spec.prompt_len` ids unique to the request (no false prefix hits between text prompts).
Requests are sampled with `ignore_eos` and `temperature=0`, so each runs to `max_tokens`.

`replay(core, clock, specs)` is the same loop over any EngineCore and any clock with
`clock()` / `advance_to(t)`: with a real executor and `WallClock` it replays a workload on
the real engine in real time (the fidelity benchmark uses it to measure what the simulator
predicts, through the very same loop).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis.metrics import summarize
from analysis.record import RequestRecord
from analysis.runfolder import steps_frame
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreOutput, EngineCoreRequest, FinishReason, StepStats
from engine.sim.executor import SimulatedExecutor
from workloads.record_builder import build_record
from workloads.send_schedule import Send, SendSchedule
from workloads.spec import RequestSpec
from workloads.trace_workload import BlockTokens
from workloads.traces import TraceRow

Tokenize = Callable[[str], list[int]]


class Clock(Protocol):
    """What the loop needs of time: read it, and wait (or jump) until a send time."""

    def clock(self) -> float: ...

    def advance_to(self, t: float) -> None: ...


class WallClock:
    """Real time (`time.time`, the InProcessExecutor's clock); `advance_to` sleeps."""

    def clock(self) -> float:
        return time.time()

    def advance_to(self, t: float) -> None:
        wait = t - time.time()
        if wait > 0:
            time.sleep(wait)


_UNIQUE_BASE = 1000  # first id of the per-request unique prompt ids


@dataclass
class SimResult:
    """A simulated run: records and steps as the workbench stores them.

    `records` are sorted like the driver's (scheduled time, id); `steps` hold absolute
    virtual times (`t0` is the virtual time of the run start); `wall_s` is the real time
    the simulation took and `sim_s` the simulated duration.
    """

    records: list[RequestRecord]
    steps: list[StepStats]
    wall_s: float
    sim_s: float
    t0: float = 0.0
    slo: dict[str, float | None] | None = None
    stop_reason: str = ""

    def steps_frame(self) -> pd.DataFrame:
        """steps.csv rows (time rebased to the run start)."""
        return steps_frame(self.steps, self.t0)

    def summary(self) -> dict[str, Any]:
        """summary.json as for a real run, plus `sim_wall_s` and `sim_speedup`."""
        out = summarize(self.records, slo=self.slo, steps=self.steps_frame())
        out["sim_wall_s"] = self.wall_s
        out["sim_speedup"] = self.sim_s / self.wall_s if self.wall_s > 0 else None
        return out


@dataclass(slots=True)
class _Live:
    """A request in the engine: its send and what the client has seen so far (relative times)."""

    send: Send
    spec: RequestSpec  # send.spec, read per output token
    scheduled_s: float
    start_s: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class _Loop:
    """The discrete-event loop of one simulated run (see the module docstring)."""

    def __init__(
        self,
        core: EngineCore,
        executor: Clock,
        schedule: SendSchedule,
        *,
        tokenize: Tokenize | None,
        max_duration_s: float | None,
        bar: tqdm | None,
    ) -> None:
        self.core, self.ex = core, executor
        self.schedule = schedule
        self.tokenize, self.max_duration_s, self.bar = tokenize, max_duration_s, bar
        self.t0 = executor.clock()
        self.sends: list[tuple[float, int, Send]] = []  # (time, seq, send) heap
        self.seq = itertools.count()
        self.slot_queue: deque[tuple[Send, float]] = deque()  # open loop, waiting for a slot
        self.free_slots = schedule.slots
        self.live: dict[str, _Live] = {}
        self.records: list[RequestRecord] = []
        self.steps: list[StepStats] = []
        self.sampling = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    # ---- sends ----------------------------------------------------------------------
    def start(self, specs: list[RequestSpec]) -> None:
        for send in self.schedule.first(specs):
            self._push(send, self.t0)

    def _push(self, send: Send, now: float) -> None:
        """Plan `send`: at its time since the run start, or at `now` when it has none."""
        t = now if send.at_s is None else self.t0 + send.at_s
        heapq.heappush(self.sends, (t, next(self.seq), send))

    def release_due(self, now: float) -> None:
        """Send every spec whose time has come (open loop with concurrency: once a slot is free)."""
        sends = self.sends
        while sends and sends[0][0] <= now:
            t, _, send = heapq.heappop(sends)
            if self.schedule.slots:
                self.slot_queue.append((send, t))
            else:
                self._send(send, t, now)
        while self.slot_queue and self.free_slots > 0:
            send, t = self.slot_queue.popleft()
            self.free_slots -= 1
            self._send(send, t, now)

    def _send(self, send: Send, scheduled: float, now: float) -> None:
        spec = send.spec
        ids = self._prompt_ids(spec)
        self.core.add_request(EngineCoreRequest(
            request_id=spec.request_id, prompt_token_ids=ids, sampling_params=self.sampling,
            eos_token_id=self.core.eos_token_id, arrival_time=now, max_tokens=spec.max_tokens,
            priority=spec.priority,
        ))  # fmt: skip
        self.live[spec.request_id] = _Live(send, spec, scheduled - self.t0, now - self.t0, len(ids))

    def _prompt_ids(self, spec: RequestSpec) -> list[int]:
        if spec.prompt_token_ids is not None:
            return spec.prompt_token_ids
        if self.tokenize is not None and spec.prompt is not None:
            return self.tokenize(spec.prompt)
        base = _UNIQUE_BASE + (next(self.seq) * 7919) % 1_000_000
        return list(range(base, base + max(1, spec.prompt_len)))

    # ---- the loop -------------------------------------------------------------------
    def run(self) -> str:
        """Step until every request finished; returns a stop reason ('' or 'max_duration')."""
        ex, core = self.ex, self.core
        deadline = None if self.max_duration_s is None else self.t0 + self.max_duration_s
        while True:
            now = ex.clock()
            if deadline is not None and now >= deadline:
                return "max_duration"
            self.release_due(now)
            if core.has_unfinished_requests():
                out = core.step()
                self.steps.append(out.stats)  # type: ignore[arg-type]
                self._absorb(out.outputs, out.timestamp - self.t0)
            elif self.sends:
                ex.advance_to(self.sends[0][0] if deadline is None else min(self.sends[0][0], deadline))
            else:
                return ""

    def _absorb(self, outputs: list[EngineCoreOutput], t_rel: float) -> None:
        live = self.live
        for o in outputs:
            req = live.get(o.request_id)
            if req is None:
                continue
            new = o.new_token_ids
            if new:
                if len(new) == 1:
                    req.token_times.append(t_rel)
                else:
                    req.token_times.extend([t_rel] * len(new))
                if req.spec.follow_up is not None:
                    req.token_ids.extend(new)
            if o.finish_reason is not None:
                self._finish(live.pop(o.request_id), o, t_rel)

    def _finish(self, req: _Live, o: EngineCoreOutput, t_rel: float) -> None:
        record = _record(req, o, t_rel)
        self.records.append(record)
        if self.bar is not None:
            self.bar.update(1)
        if self.schedule.slots:
            self.free_slots += 1
        nxt = self.schedule.after(req.send, record)
        if nxt is not None:
            if nxt.is_follow_up and self.bar is not None:
                self.bar.total += 1
            self._push(nxt, self.t0 + t_rel)

    def interrupted_records(self) -> list[RequestRecord]:
        """Records of requests still in flight (a max_duration stop)."""
        done_s = self.ex.clock() - self.t0
        return [
            _client_record(req, done_s=done_s, finish_reason="abort", error="interrupted before completion")
            for req in self.live.values()
        ]


def _client_record(req: _Live, **fields: Any) -> RequestRecord:
    """`build_record` with what the client saw of `req` (send, first-token and token times)."""
    return build_record(req.spec, scheduled_s=req.scheduled_s, start_s=req.start_s, token_times=req.token_times,
                        prompt_tokens=req.prompt_tokens, **fields)  # fmt: skip


def _record(req: _Live, o: EngineCoreOutput, t_rel: float) -> RequestRecord:
    """The finished request's record; server times from the engine's (virtual) timestamps."""
    queued = prefill = decode = None
    arrival, first = o.arrival_time, o.first_scheduled_time
    if first:
        queued = first - arrival
        if o.first_token_time:
            prefill = o.first_token_time - first
            decode = o.finished_time - o.first_token_time
    return _client_record(
        req,
        done_s=req.token_times[-1] if req.token_times else t_rel,
        finish_reason=str(FinishReason(o.finish_reason)) if o.finish_reason is not None else "",
        error=o.error or "",
        output_token_ids=req.token_ids if req.spec.follow_up is not None else None,
        server_queued_s=queued, server_prefill_s=prefill, server_decode_s=decode,
    )


def simulate(
    specs: list[RequestSpec],
    engine_config: EngineConfig,
    executor: SimulatedExecutor,
    slo: dict[str, float | None] | None = None,
    progress: bool = False,
    **options: Any,
) -> SimResult:
    """Run `specs` (sorted by arrival_s) through an EngineCore on `executor`; see the module doc.

    `slo` (ms limits, as for `summarize`) is kept for `SimResult.summary()`; `options`
    (closed_loop, concurrency, tokenize, max_duration_s) are those of `replay`.
    """
    wall0 = time.perf_counter()
    core = EngineCore(engine_config, executor=executor)
    res = replay(core, executor, specs, slo, progress, **options)
    res.wall_s = time.perf_counter() - wall0
    return res


def replay(
    core: EngineCore,
    clock: Clock,
    specs: list[RequestSpec],
    slo: dict[str, float | None] | None = None,
    progress: bool = False,
    *,
    closed_loop: bool = False,
    concurrency: int | None = None,
    tokenize: Tokenize | None = None,
    max_duration_s: float | None = None,
) -> SimResult:
    """The loop of `simulate` over a given (idle) `core`, on `clock` (its executor's clock).

    With a `SimulatedExecutor` as both core executor and clock this is `simulate`; with the
    real executor and `WallClock` it replays the workload in real time.
    """
    schedule = SendSchedule(closed_loop=closed_loop, concurrency=concurrency)
    if core.has_unfinished_requests():
        raise ValueError("replay() needs an idle engine")
    wall0 = time.perf_counter()
    bar = tqdm(total=len(specs), unit="req", disable=not progress, smoothing=0.1) if progress else None
    loop = _Loop(core, clock, schedule, tokenize=tokenize, max_duration_s=max_duration_s, bar=bar)
    loop.start(specs)
    stop_reason = loop.run()
    records = loop.records
    if stop_reason:
        records += loop.interrupted_records()
    if bar is not None:
        bar.close()
    records.sort(key=lambda r: (r.scheduled_s, r.request_id))
    return SimResult(
        records=records, steps=loop.steps, wall_s=time.perf_counter() - wall0,
        sim_s=clock.clock() - loop.t0, t0=loop.t0, slo=slo, stop_reason=stop_reason,
    )  # fmt: skip


def trace_token_specs(
    rows: list[TraceRow], vocab_size: int, *, seed: int = 0, block_size: int = 512, id_prefix: str = "trace"
) -> list[RequestSpec]:
    """One token-id spec per trace row, without a tokenizer (for models not at hand).

    Prompts are random ids in [0, vocab_size) from a generator seeded per run; rows with
    `hash_ids` keep their prefix structure (`BlockTokens`: equal hash ids, equal blocks).
    """
    rng = np.random.default_rng(seed)
    blocks = (
        BlockTokens(list(range(vocab_size)), block_size, salt=seed) if any(r.hash_ids for r in rows) else None
    )
    specs = []
    for i, r in enumerate(rows):
        n = max(1, r.prompt_tokens)
        ids = rng.integers(0, vocab_size, size=n).tolist()
        if r.hash_ids and blocks is not None:
            ids = blocks.prompt(r.hash_ids, n, ids)
        specs.append(RequestSpec(f"{id_prefix}-{i}", r.timestamp_s, None, ids, n, max(1, r.output_tokens),
                                 group=r.group))  # fmt: skip
    return specs
