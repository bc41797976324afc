"""Capacity search: the highest request rate whose run meets the SLOs, and replicas for a target.

The search treats a run as a black box `run(rate) -> summary` (summary.json keys, e.g.
`p99_ttft_ms`), so it works with a simulated engine and with a real one alike. It
assumes latency grows with the rate: it doubles the rate while the SLOs hold, then
bisects between the last passing and the first failing rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Summary = Mapping[str, Any]


@dataclass(frozen=True)
class SLO:
    """Upper limits (`max`) and lower limits (`min`) on summary keys.

    e.g. SLO(max={"p99_ttft_ms": 2000, "p99_tpot_ms": 100}, min={"completed_fraction": 0.99})
    """

    max: Mapping[str, float] = field(default_factory=dict)
    min: Mapping[str, float] = field(default_factory=dict)

    def violations(self, summary: Summary) -> list[str]:
        """Human-readable list of broken limits; a key absent from the summary is an error."""
        missing = [k for k in (*self.max, *self.min) if k not in summary]
        if missing:
            raise KeyError(f"summary lacks SLO keys {missing}")
        out = [f"{k}={summary[k]:.4g} > {v:.4g}" for k, v in self.max.items() if summary[k] > v]
        out += [f"{k}={summary[k]:.4g} < {v:.4g}" for k, v in self.min.items() if summary[k] < v]
        return out

    def met(self, summary: Summary) -> bool:
        return not self.violations(summary)


@dataclass
class Evaluation:
    rate: float
    ok: bool
    violations: list[str]
    summary: Summary


@dataclass
class RateSearch:
    max_rate: float  # highest rate that met the SLOs (0.0: none did)
    evaluations: list[Evaluation]

    @property
    def best(self) -> Evaluation | None:
        passing = [e for e in self.evaluations if e.ok]
        return max(passing, key=lambda e: e.rate) if passing else None


def find_max_rate(
    run: Callable[[float], Summary],
    slo: SLO,
    *,
    start: float = 1.0,
    rate_limit: float = 1e6,
    rel_tol: float = 0.05,
    max_evals: int = 30,
) -> RateSearch:
    """Highest rate in (0, rate_limit] meeting `slo`, to within `rel_tol` (relative).

    Calls `run` at most `max_evals` times. If `start` fails, the search halves downwards.
    A summary with `saturated` true fails whatever its latencies: the doubling never climbs past
    the first saturated rate.
    """
    evals: list[Evaluation] = []

    def check(rate: float) -> bool:
        summary = run(rate)
        bad = slo.violations(summary)
        if summary.get("saturated"):  # the queue grows: a longer run would break any latency SLO
            bad.append("saturated (the target no longer keeps up: workloads/saturation.py)")
        evals.append(Evaluation(rate, not bad, bad, summary))
        return not bad

    lo, hi = _bracket(check, min(start, rate_limit), rate_limit, lambda: len(evals) < max_evals)
    while len(evals) < max_evals and not math.isinf(hi) and lo > 0 and hi / lo - 1 > rel_tol:
        mid = (lo + hi) / 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return RateSearch(lo, evals)


def _bracket(
    check: Callable[[float], bool], start: float, rate_limit: float, budget_left: Callable[[], bool]
) -> tuple[float, float]:
    """(lo, hi): lo passed (0.0: none did), hi failed (inf: none did). Doubles up or halves down."""
    if check(start):
        lo = start
        while lo < rate_limit and budget_left():
            rate = min(2 * lo, rate_limit)
            if not check(rate):
                return lo, rate
            lo = rate
        return lo, math.inf
    hi = start
    while hi > start * 2.0**-20 and budget_left():
        if check(hi / 2):
            return hi / 2, hi
        hi /= 2
    return 0.0, hi


def replicas_for_rate(target_rate: float, max_rate_per_replica: float) -> int:
    """Engine replicas (each one the searched configuration) to serve `target_rate` req/s."""
    if max_rate_per_replica <= 0:
        raise ValueError("one replica meets the SLOs at no rate: no replica count suffices")
    return max(1, math.ceil(target_rate / max_rate_per_replica - 1e-9))
