"""Simulated runs: the engine's own EngineCore and scheduler on a `SimulatedExecutor`'s virtual clock.

`simulate(specs, engine_config, executor)` replays a workload as a discrete-event loop:
requests whose send time has come (on the virtual clock) are added to the engine; while the
engine has work it steps (each step advances the clock by the modelled step time); when it
is idle the clock jumps to the next send time. It returns the same `RequestRecord`s the real
driver produces (times in seconds since the run start, one time per output token: the end of
the step that produced it), so `workloads.metrics.summarize`, the run folder and the reports
work unchanged.

Send times follow the driver's rules: open loop sends each spec at `arrival_s` (with
`concurrency`, a spec waits for a free slot); closed loop (`closed_loop=True`) keeps
`concurrency` users, each sending its next spec when its previous one finished; a finished
spec's `follow_up` (multi-turn) is sent at the follow-up's `arrival_s`. There is no client
or network: lateness is 0 and TTFT is measured from the send.

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

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore, EngineCoreRequest
from engine.outputs import EngineCoreOutput, FinishReason, StepStats
from engine.sampling_params import SamplingParams
from engine.sim.executor import SimulatedExecutor
from workloads.metrics import summarize
from workloads.record import RequestRecord
from workloads.runfolder import steps_frame
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
    """A request in the engine: its spec and what the client has seen so far (relative times)."""

    spec: RequestSpec
    scheduled_s: float
    start_s: float
    prompt_tokens: int
    user: int = -1  # closed-loop user slot, -1 in open loop
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class _Loop:
    """The discrete-event loop of one simulated run (see the module docstring)."""

    def __init__(
        self,
        core: EngineCore,
        executor: Clock,
        *,
        closed_loop: bool,
        concurrency: int | None,
        tokenize: Tokenize | None,
        max_duration_s: float | None,
        bar: tqdm | None,
    ) -> None:
        self.core, self.ex = core, executor
        self.closed_loop, self.concurrency = closed_loop, concurrency
        self.tokenize, self.max_duration_s, self.bar = tokenize, max_duration_s, bar
        self.t0 = executor.clock()
        self.sends: list[tuple[float, int, RequestSpec, int]] = []  # (time, seq, spec, user) heap
        self.seq = itertools.count()
        self.slot_queue: deque[tuple[RequestSpec, float]] = deque()  # open loop, waiting for a slot
        self.free_slots = concurrency or 0
        self.queue: deque[RequestSpec] = deque()  # closed loop: specs not yet sent
        self.live: dict[str, _Live] = {}
        self.records: list[RequestRecord] = []
        self.steps: list[StepStats] = []
        self.sampling = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    # ---- sends ----------------------------------------------------------------------
    def start(self, specs: list[RequestSpec]) -> None:
        if self.closed_loop:
            self.queue.extend(specs)
            for user in range(self.concurrency or 1):
                self._next_from_queue(user, self.t0)
        else:
            for spec in specs:
                self._push(self.t0 + spec.arrival_s, spec, -1)

    def _push(self, t: float, spec: RequestSpec, user: int) -> None:
        heapq.heappush(self.sends, (t, next(self.seq), spec, user))

    def _next_from_queue(self, user: int, now: float) -> None:
        if self.queue:
            self._push(now, self.queue.popleft(), user)

    def release_due(self, now: float) -> None:
        """Send every spec whose time has come (open loop with concurrency: once a slot is free)."""
        sends = self.sends
        while sends and sends[0][0] <= now:
            t, _, spec, user = heapq.heappop(sends)
            if self.concurrency and not self.closed_loop:
                self.slot_queue.append((spec, t))
            else:
                self._send(spec, t, now, user)
        while self.slot_queue and self.free_slots > 0:
            spec, t = self.slot_queue.popleft()
            self.free_slots -= 1
            self._send(spec, t, now, -1)

    def _send(self, spec: RequestSpec, scheduled: float, now: float, user: int) -> None:
        ids = self._prompt_ids(spec)
        self.core.add_request(EngineCoreRequest(
            request_id=spec.request_id, prompt_token_ids=ids, sampling_params=self.sampling,
            eos_token_id=self.core.eos_token_id, arrival_time=now, max_tokens=spec.max_tokens,
            priority=spec.priority,
        ))  # fmt: skip
        self.live[spec.request_id] = _Live(spec, scheduled - self.t0, now - self.t0, len(ids), user)

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
        record = _record(req, o, t_rel, self.t0)
        self.records.append(record)
        if self.bar is not None:
            self.bar.update(1)
        now = self.t0 + t_rel
        nxt = req.spec.follow_up(req.spec, record) if req.spec.follow_up is not None else None
        if nxt is not None and self.bar is not None:
            self.bar.total += 1
        if self.closed_loop:
            if nxt is not None:
                self._push(self.t0 + nxt.arrival_s, nxt, req.user)
            else:
                self._next_from_queue(req.user, now)
            return
        if self.concurrency:
            self.free_slots += 1
        if nxt is not None:
            self._push(self.t0 + nxt.arrival_s, nxt, -1)

    def interrupted_records(self) -> list[RequestRecord]:
        """Records of requests still in flight or never sent (a max_duration stop)."""
        out = []
        for req in self.live.values():
            rec = _base_record(req)
            rec.error, rec.finish_reason, rec.done_s = (
                "interrupted before completion",
                "abort",
                self.ex.clock() - self.t0,
            )
            out.append(rec)
        return out


def _base_record(req: _Live) -> RequestRecord:
    spec = req.spec
    return RequestRecord(
        request_id=spec.request_id, scheduled_s=req.scheduled_s, start_s=req.start_s,
        token_times=req.token_times, prompt_tokens=req.prompt_tokens, output_tokens=len(req.token_times),
        is_warmup=spec.is_warmup, group=spec.group, session_id=spec.session_id, turn=spec.turn,
    )  # fmt: skip


def _record(req: _Live, o: EngineCoreOutput, t_rel: float, t0: float) -> RequestRecord:
    """The finished request's record; server times from the engine's (virtual) timestamps."""
    rec = _base_record(req)
    rec.done_s = req.token_times[-1] if req.token_times else t_rel
    rec.finish_reason = str(FinishReason(o.finish_reason)) if o.finish_reason is not None else ""
    rec.error = o.error or ("" if req.token_times else "no content chunk received")
    rec.output_token_ids = req.token_ids if req.spec.follow_up is not None else None
    arrival, first = o.arrival_time, o.first_scheduled_time
    if first:
        rec.server_queued_s = first - arrival
        if o.first_token_time:
            rec.server_prefill_s = o.first_token_time - first
            rec.server_decode_s = o.finished_time - o.first_token_time
    return rec


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
    if closed_loop and not concurrency:
        raise ValueError("closed loop needs concurrency >= 1")
    if core.has_unfinished_requests():
        raise ValueError("replay() needs an idle engine")
    wall0 = time.perf_counter()
    bar = tqdm(total=len(specs), unit="req", disable=not progress, smoothing=0.1) if progress else None
    loop = _Loop(core, clock, closed_loop=closed_loop, concurrency=concurrency, tokenize=tokenize,
                 max_duration_s=max_duration_s, bar=bar)  # fmt: skip
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
