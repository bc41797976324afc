"""The asyncio load driver: open loop (sends at planned times) or closed loop (N users).

What is sent when follows `workloads.send_schedule.SendSchedule` (the rules the simulator
shares). Open loop: a dispatcher sleeps until each request's planned time and starts a task
for it; it never waits for responses, so a slow response cannot delay the next send. With
`concurrency` set, a started request first waits for a slot (vLLM's `--max-concurrency`); that
wait is client queue time, not driver lateness.

Closed loop: `concurrency` users, one coroutine each; each sends its next spec when its
previous request ended.

Times are `time.perf_counter()` seconds since the run start `t0`. Per request the driver
records its planned time, the actual send, every content chunk (via `on_token`, so a cancelled
request keeps what it received) and its lateness: actual send minus the moment it could have
been sent (planned time, or slot acquisition if later).

Dependent requests: when a finished request's spec has `follow_up`, its result (the next turn)
is sent at its planned `arrival_s` (open loop) or next by the same user (closed loop).

Bounded: `max_duration_s` stops sending and cancels what is in flight; cancelling `run()`
(Ctrl-C under `asyncio.run`) does the same. Either way `run()` returns what was measured,
with `stop_reason` set, and in-flight requests recorded with an "interrupted" error.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from analysis.record import RequestRecord, TargetResult
from engine.seam import StepStats
from workloads.record_builder import record_from_result
from workloads.saturation import SaturationMonitor
from workloads.send_schedule import Send, SendSchedule
from workloads.spec import RequestSpec
from workloads.targets.base import Target

ProgressFn = Callable[[int, float], None]  # (requests done, current rate in req/s)
_TIMER_SLACK_S = 0.0011  # wake this early from a timer, then yield until due

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    records: list[RequestRecord]
    t0_wall: float  # time.time() at the run start (to place engine step times)
    wall_s: float  # run start to end, including any drain
    stop_reason: str = ""  # "" | "max_duration" | "cancelled"
    steps: list[StepStats] | None = None
    scraped: list[dict[str, float]] = field(default_factory=list)
    metrics_error: str | None = None

    @property
    def interrupted(self) -> bool:
        return bool(self.stop_reason)


class _Partial:
    """Chunks seen so far for one request (kept if the request is cancelled)."""

    __slots__ = ("times", "tokens")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def add(self, t: float, k: int) -> None:
        self.times.append(t)
        self.tokens.append(k)


class Driver:
    """Runs one workload against one target. Use a new Driver per run."""

    def __init__(
        self, target: Target, *, closed_loop: bool = False, concurrency: int | None = None,
        max_duration_s: float | None = None, progress: bool = False, on_progress: ProgressFn | None = None,
        scrape_interval_s: float | None = None, on_record: Callable[[RequestRecord], None] | None = None,
        saturation: SaturationMonitor | None = None,
    ) -> None:
        """`on_record` sees each request's record as soon as it is complete (the run folder's
        journal, so an interrupted or killed harness keeps every finished request).
        `saturation`: stop the run (stop_reason "saturated") once the monitor finds that the
        target no longer keeps up (workloads/saturation.py; open loop only)."""
        self.saturation = saturation
        self.schedule = SendSchedule(closed_loop=closed_loop, concurrency=concurrency)
        self.on_record = on_record
        self.target = target
        self.max_duration_s = max_duration_s
        self.progress, self.on_progress = progress, on_progress
        self.scrape_interval_s = scrape_interval_s
        self.records: list[RequestRecord] = []
        self._tasks: set[asyncio.Task] = set()
        self._sem: asyncio.Semaphore | None = None
        self._stopping = False
        self._t0 = 0.0
        self._bar: tqdm | None = None
        self._scraped: list[dict[str, float]] = []
        self.metrics_error: str | None = None  # why the server's /metrics could not be read

    def now(self) -> float:
        """Seconds since the run start."""
        return time.perf_counter() - self._t0

    async def run(self, specs: list[RequestSpec]) -> RunResult:
        """Send `specs` (sorted by arrival_s) and return every request's record.

        Objects alive before the run are frozen out of the garbage collector for its
        duration: a full collection over them stalls the event loop for tens of ms.
        """
        gc.freeze()
        try:
            return await self._run(specs)
        finally:
            gc.unfreeze()

    async def _run(self, specs: list[RequestSpec]) -> RunResult:
        self._t0, t0_wall = time.perf_counter(), time.time()
        self._bar = tqdm(total=len(specs), unit="req", disable=not self.progress, smoothing=0.1)
        first = self.schedule.first(specs)
        main = asyncio.ensure_future(self._closed(first) if self.schedule.closed_loop else self._open(first))
        scraper = asyncio.ensure_future(self._scrape()) if self.scrape_interval_s else None
        watch = asyncio.ensure_future(self._watch_saturation()) if self.saturation else None
        stop_reason = ""
        try:
            done, _ = await asyncio.wait({main, *([watch] if watch else [])}, timeout=self.max_duration_s,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if not done:
                stop_reason = "max_duration"
            elif main not in done:
                stop_reason = "saturated"
            else:
                main.result()
                if scraper is not None and self.metrics_error is None:
                    await self._scrape_once()  # the counters' final values, after the last request
        except asyncio.CancelledError:
            stop_reason = "cancelled"
        finally:
            await self._shutdown(main, scraper, watch)
        return RunResult(
            records=sorted(self.records, key=lambda r: (r.scheduled_s, r.request_id)),
            t0_wall=t0_wall, wall_s=self.now(), stop_reason=stop_reason,
            steps=self.target.step_stats(), scraped=self._scraped, metrics_error=self.metrics_error,
        )

    async def _shutdown(self, main: asyncio.Future, *helpers: asyncio.Future | None) -> None:
        self._stopping = True
        pending = [main, *self._tasks, *(h for h in helpers if h is not None)]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._bar is not None:
            self._bar.close()

    async def _open(self, first: list[Send]) -> None:
        if self.schedule.slots:
            self._sem = asyncio.Semaphore(self.schedule.slots)
        for send in first:
            await self._sleep_until(send.at_s or 0.0)
            self._spawn(self._open_send(send))
        while self._tasks:  # follow-ups may add tasks while we wait
            await asyncio.wait(set(self._tasks))

    async def _open_send(self, send: Send) -> None:
        """Send a due open-loop request; its follow-up, if any, becomes a task of its own."""
        record = await self._send(send.spec, send.at_s or 0.0)
        nxt = self._after(send, record)
        if nxt is not None:
            self._spawn(self._delayed(nxt))

    async def _delayed(self, send: Send) -> None:
        await self._sleep_until(send.at_s or 0.0)
        await self._open_send(send)

    async def _closed(self, first: list[Send]) -> None:
        await asyncio.gather(*(self._user(send) for send in first))

    async def _user(self, send: Send | None) -> None:
        """One closed-loop user: send, wait for the end, send what the schedule says next."""
        while send is not None and not self._stopping:
            if send.at_s is None:
                scheduled = self.now()
            else:  # a follow-up turn, at its planned time
                scheduled = send.at_s
                await self._sleep_until(scheduled)
            record = await self._send(send.spec, scheduled)
            send = self._after(send, record)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, spec: RequestSpec, scheduled: float) -> RequestRecord:
        """Send one request (after a concurrency slot, if any) and store its record."""
        ready = scheduled
        if self._sem is not None:
            await self._sem.acquire()
            ready = max(scheduled, self.now())
        partial = _Partial()
        start = self.now()
        if self.saturation is not None:
            self.saturation.sent(partial, start, spec)
        try:
            result = await self.target.send(spec, partial.add)
        except asyncio.CancelledError:
            cut = TargetResult(chunk_times=partial.times, chunk_tokens=partial.tokens,
                               error="interrupted before completion", finish_reason="abort")
            self._store(spec, cut, scheduled, start, start - ready)
            raise
        except Exception as exc:  # a target bug must not end the run: record it
            result = TargetResult(error=f"{type(exc).__name__}: {exc}", finish_reason="error")
        finally:
            if self._sem is not None:
                self._sem.release()
            if self.saturation is not None:
                self.saturation.done(partial, self.now())
        return self._store(spec, result, scheduled, start, start - ready)

    def _after(self, send: Send, record: RequestRecord) -> Send | None:
        if self._stopping:
            return None
        nxt = self.schedule.after(send, record)
        if nxt is not None and nxt.is_follow_up and self._bar is not None:
            self._bar.total += 1
        return nxt

    def _store(
        self, spec: RequestSpec, result: TargetResult, scheduled: float, start: float, lateness: float
    ) -> RequestRecord:
        rec = record_from_result(spec, result, t0=self._t0, scheduled_s=scheduled, start_s=start,
                                 lateness_s=max(0.0, lateness), now_s=self.now())
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        self._report_progress()
        return rec

    def _report_progress(self) -> None:
        done = len(self.records)
        if self._bar is not None:
            self._bar.update(1)
        if self.on_progress is not None:
            elapsed = self.now()
            self.on_progress(done, done / elapsed if elapsed > 0 else 0.0)

    async def _sleep_until(self, t_rel: float) -> None:
        """Wake at `t_rel`: sleep to just before it, then yield to the loop until it is due.

        The event loop's timers wake up to ~1 ms late (epoll has ms resolution); the final
        yields (which let other requests' tasks run) make sends sub-ms punctual.
        """
        delay = t_rel - self.now()
        if delay > _TIMER_SLACK_S:
            await asyncio.sleep(delay - _TIMER_SLACK_S)
        while self.now() < t_rel:
            await asyncio.sleep(0)

    async def _watch_saturation(self) -> None:
        """Returns once the monitor says the target no longer keeps up."""
        assert self.saturation is not None
        while not self.saturation.check(self.now()):
            await asyncio.sleep(self.saturation.check_interval_s)

    async def _scrape(self) -> None:
        while await self._scrape_once():
            await asyncio.sleep(self.scrape_interval_s or 1.0)

    async def _scrape_once(self) -> bool:
        """One row of server metrics; False once the server said it has none (then stop asking)."""
        row = await self.target.scrape_metrics()
        if row is not None:
            self._scraped.append({"time": self.now(), **row})
            return True
        error = getattr(self.target, "metrics_error", None)
        if error:
            logger.warning("server metrics unavailable (%s); not polling /metrics again this run", error)
            self.metrics_error = error
            return False
        return True


async def run_workload(specs: list[RequestSpec], target: Target, **driver_kwargs) -> RunResult:
    """Start the target, run the workload through a new `Driver`, stop the target."""
    await target.start()
    try:
        return await Driver(target, **driver_kwargs).run(specs)
    finally:
        await target.stop()
