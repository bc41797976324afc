"""The `Target` protocol: the one seam between the load driver and what it measures.

Contract of `send(spec, on_token)`:
- called by the driver right after it stamped the request's start time;
- calls `on_token(t, k)` for every chunk that carries generated content, with `t` the
  `time.perf_counter()` of its arrival and `k` the output tokens in it (server counts, or the
  best estimate so far); the driver keeps these, so a cancelled send still leaves its partial
  timings;
- returns a `TargetResult` whose `chunk_times` / `chunk_tokens` repeat those calls (final,
  reconciled with the server's usage counts); it reports failures in `TargetResult.error`
  instead of raising (the driver also turns exceptions into errors).

`step_stats()` returns the engine steps seen since `start()` (None when the target cannot
see its engine); `scrape_metrics()` returns one row of server gauges (None when unsupported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from analysis.record import TargetResult
from engine.seam import StepStats
from workloads.spec import RequestSpec

OnToken = Callable[[float, int], None]


@runtime_checkable
class Target(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(self, spec: RequestSpec, on_token: OnToken | None = None) -> TargetResult: ...

    def step_stats(self) -> list[StepStats] | None: ...

    async def scrape_metrics(self) -> dict[str, float] | None: ...
