"""Over-saturation: an open-loop run whose target no longer keeps up (GuideLLM's idea).

Below capacity, an open loop reaches a steady state: requests in flight and TTFT fluctuate
around a level. Above it, the queue grows without bound: both climb for as long as requests
keep arriving. The test, over the sending phase (first send to last send, or to now while
sending):

1. cut it into `windows` equal windows and drop the first (the ramp-up, where in-flight rises
   in any run);
2. per window, the time-averaged number of requests in flight (sent, not yet finished) and the
   median wait for a first token: the TTFT of the requests whose first token came in the window,
   with the time waited so far by those still waiting at its end (so a run read while it sends
   and the finished run give the same figures for the windows both cover);
3. saturated when both series rise steadily: Spearman's rank correlation with the window index
   at least `min_rho` for each (0.8 over 9 windows: p < 0.01 for a series without trend), and
   each grew, last two windows against first two, by at least `min_growth` times (in flight also
   by at least 2 requests), so a drift of a few percent does not count.

A closed loop cannot over-saturate (its users wait for answers); it is never tested.
`saturation_summary(records)` gives the summary.json figures of a finished run;
`SaturationMonitor` runs the same test while the driver sends (`run.stop_when_saturated`).
Both see the same requests (`counted`): warm-up requests are left out of each, so a cold start
that queues the warm-up (the look of an over-saturated run) neither stops a run nor marks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from analysis.record import RequestRecord
from workloads.send_schedule import send_limits
from workloads.spec import RequestSpec

WINDOWS = 10
MIN_RHO = 0.8
MIN_GROWTH = 1.5
MIN_REQUESTS = 20


@dataclass(frozen=True)
class Verdict:
    saturated: bool
    reason: str
    rho_in_flight: float = float("nan")
    rho_ttft: float = float("nan")
    in_flight: list[float] = field(default_factory=list)  # per window (the first dropped)
    ttft_s: list[float] = field(default_factory=list)


def detect(
    sends: Sequence[float],
    firsts: Sequence[float],
    ends: Sequence[float],
    now: float,
    *,
    windows: int = WINDOWS,
    min_rho: float = MIN_RHO,
    min_growth: float = MIN_GROWTH,
    min_requests: int = MIN_REQUESTS,
) -> Verdict:
    """The test of the module doc. Per request: send time, first-token time and end time in
    seconds (NaN: not yet / never), all on one clock; `now` ends the observed span."""
    s, f, e = (np.asarray(a, dtype=np.float64) for a in (sends, firsts, ends))
    s_ok = s <= now
    if s_ok.sum() < min_requests:
        return Verdict(False, f"too few requests to tell ({int(s_ok.sum())} < {min_requests})")
    s, f, e = s[s_ok], f[s_ok], e[s_ok]
    t0 = float(s.min())
    if now <= t0:
        return Verdict(False, "no time span")
    edges = np.linspace(t0, now, windows + 1)
    end = np.where(np.isnan(e), now, e)  # (windows end at `now`: a later end is cut there)
    # failed requests never get a first token: their wait ends when they do
    first = np.where(np.isnan(f), np.where(np.isnan(e), np.inf, e), f)
    in_flight, med = [], []
    for a, b in zip(edges[1:-1], edges[2:], strict=True):
        overlap = np.clip(np.minimum(end, b) - np.maximum(s, a), 0.0, None)
        in_flight.append(float(overlap.sum() / (b - a)))
        got = (first > a) & (first <= b)
        waiting = (s < b) & (first > b)
        waits = np.concatenate([first[got] - s[got], b - s[waiting]])
        med.append(float(np.median(waits)) if len(waits) else np.nan)
    med_arr = np.array(med)
    if np.isnan(med_arr).sum() > len(med_arr) // 2:
        return Verdict(False, "too few windows with a TTFT", in_flight=in_flight, ttft_s=med)
    idx = np.arange(len(in_flight))
    keep = ~np.isnan(med_arr)
    rho_c = float(stats.spearmanr(idx, in_flight).statistic) if np.ptp(in_flight) > 0 else 0.0
    rho_t = float(stats.spearmanr(idx[keep], med_arr[keep]).statistic) if np.ptp(med_arr[keep]) > 0 else 0.0
    c_first, c_last = float(np.mean(in_flight[:2])), float(np.mean(in_flight[-2:]))
    known = med_arr[keep]
    t_first, t_last = float(np.mean(known[:2])), float(np.mean(known[-2:]))
    rising = rho_c >= min_rho and rho_t >= min_rho
    grew = c_last >= max(min_growth * c_first, c_first + 2) and t_last >= min_growth * t_first
    figures = dict(rho_in_flight=rho_c, rho_ttft=rho_t, in_flight=in_flight, ttft_s=med)
    if rising and grew:
        return Verdict(True, f"in flight {c_first:.1f} -> {c_last:.1f}, TTFT {t_first * 1e3:.0f} -> "
                             f"{t_last * 1e3:.0f} ms, rising (rank correlations {rho_c:.2f}, {rho_t:.2f})",
                       **figures)  # fmt: skip
    return Verdict(
        False, "in flight and TTFT settle" if not rising else "rising, but by too little", **figures
    )


def counted(request: RequestRecord | RequestSpec) -> bool:
    """Whether the saturation test sees this request, in the summary and while sending: every
    request but the warm-up (the summary's statistics leave it out too)."""
    return not request.is_warmup


def _record_times(records: Sequence[RequestRecord]) -> tuple[list[float], list[float], list[float]]:
    sends = [r.start_s for r in records]
    firsts = [r.token_times[0] if r.token_times else np.nan for r in records]
    ends = [r.done_s if r.done_s else (r.token_times[-1] if r.token_times else np.nan) for r in records]
    return sends, firsts, ends


def saturation_summary(records: Sequence[RequestRecord], open_loop: bool = True) -> dict[str, Any]:
    """summary.json's `saturated` (None for a closed loop: not tested), the rank correlations
    and the reason, over the sending phase of a finished run (warm-up requests left out)."""
    if not open_loop:
        return {"saturated": None, "saturation": "closed loop: not tested"}
    recs = [r for r in records if counted(r)]
    if not recs:
        return {"saturated": None, "saturation": "no requests"}
    sends, firsts, ends = _record_times(recs)
    v = detect(sends, firsts, ends, now=max(sends))
    return {"saturated": v.saturated, "saturation": v.reason,
            "saturation_rho_in_flight": v.rho_in_flight, "saturation_rho_ttft": v.rho_ttft}  # fmt: skip


class SaturationMonitor:
    """The test while a run sends: the driver calls `sent` / `done` with its own per-request
    object whose `times` list fills with chunk times; `check(now)` runs `detect` over the
    requests `counted` (the warm-up's are never kept)."""

    def __init__(self, check_interval_s: float = 1.0, min_duration_s: float = 5.0) -> None:
        self.check_interval_s = check_interval_s
        self.min_duration_s = min_duration_s
        self._live: dict[int, tuple[float, Any]] = {}
        self._done: list[tuple[float, float, float]] = []
        self.verdict: Verdict | None = None

    def sent(self, partial: Any, t: float, spec: RequestSpec) -> None:
        if counted(spec):
            self._live[id(partial)] = (t, partial)

    def done(self, partial: Any, t: float) -> None:
        start, p = self._live.pop(id(partial), (None, partial))
        if start is not None:
            self._done.append((start, p.times[0] if p.times else np.nan, t))

    def check(self, now: float) -> bool:
        """True (and `verdict` set) once the run is saturated; False before `min_duration_s`."""
        if now < self.min_duration_s:
            return False
        rows = self._done + [(s, p.times[0] if p.times else np.nan, np.nan) for s, p in self._live.values()]
        sends, firsts, ends = (list(c) for c in zip(*rows, strict=True)) if rows else ([], [], [])
        self.verdict = detect(sends, firsts, ends, now)
        return self.verdict.saturated


def run_health(cfg: Any, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The figures workloads/run_summary.py adds to summary.json: saturation (open loop only)
    and the steady-state window's figures (analysis/steady_state.py; none when saturated)."""
    from analysis.steady_state import steady_summary

    closed_loop, _ = send_limits(cfg)
    out = saturation_summary(records, open_loop=not closed_loop)
    if out["saturated"]:
        out["steady_state"] = "saturated: the queue never settles"
    else:
        out.update(steady_summary(records))
    return out
