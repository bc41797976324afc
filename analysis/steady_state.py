"""Steady-state figures and time slices (SGLang's steady-state window, AIPerf's time slices).

A run ramps up (requests in flight climb from 0), holds a plateau, then drains (the last
requests finish while nothing new arrives). Whole-run figures mix the three; a deployer wants
the plateau's. The window is found from the run's own concurrency:

- c(t) = requests in flight (sent, not yet finished) at time t, a step function;
- the plateau level L = the time-weighted median of c over the sending phase (first send to
  last send); a run that sent everything within its first tenth (a batch) has no plateau;
- the window runs from the first time c reaches 0.9 L (ramp-up over) to the last time c is at
  least 0.9 L (drain begins). It counts when it holds at least `MIN_REQUESTS` request starts
  and a quarter of the run; otherwise there is no steady state, and the summary says why.

Over the window: latency statistics of the requests sent in it that completed, output tokens
received in it and requests finished in it per second, and the mean in flight. Time slices cut
the run into `slice_s` windows from the first send with the same figures per slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.record import RequestRecord
from analysis.runfolder import json_list

LEVEL_FRACTION = 0.9
MIN_REQUESTS = 10
MIN_SHARE = 0.25


def request_frame(records: Sequence[RequestRecord]) -> pd.DataFrame:
    """start_s, end_s (done: in flight until then), ttft_ms, tpot_ms, e2el_ms, ok, token_times
    per measured request."""
    rows = []
    for r in records:
        if r.is_warmup:
            continue
        ok = not r.error and bool(r.token_times)
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        rows.append({"start_s": r.start_s, "end_s": r.done_s or r.end_s,
                     "ttft_ms": ms(r.ttft_s) if ok else None, "tpot_ms": ms(r.tpot_s) if ok else None,
                     "e2el_ms": ms(r.e2el_s) if ok else None, "ok": ok, "token_times": list(r.token_times)})  # fmt: skip
    return pd.DataFrame(
        rows, columns=["start_s", "end_s", "ttft_ms", "tpot_ms", "e2el_ms", "ok", "token_times"]
    )


def csv_frame(requests: pd.DataFrame) -> pd.DataFrame:
    """`request_frame`'s columns from a run folder's requests.csv (measured requests only)."""
    req = requests
    if "is_warmup" in req:
        req = req[~req["is_warmup"].astype(str).str.lower().isin(("true", "1"))]
    err = (req["error"].astype(object).fillna("").astype(str).str.len() > 0 if "error" in req
           else pd.Series(False, index=req.index))  # fmt: skip
    ends = req["done_s"] if "done_s" in req else req.get("end_s", req["start_s"])
    col = lambda name: req[name] if name in req else pd.Series(np.nan, index=req.index)  # noqa: E731
    ttft = col("ttft_ms")
    return pd.DataFrame({
        "start_s": req["start_s"].astype(float),
        "end_s": ends.astype(float).where(ends > 0, col("end_s")),
        "ttft_ms": ttft, "tpot_ms": col("tpot_ms"), "e2el_ms": col("e2el_ms"),
        "ok": ~err & ttft.notna(),
        "token_times": [json_list(c) for c in req["token_times"]] if "token_times" in req else [[]] * len(req),
    })  # fmt: skip


def in_flight(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(times, c): c[i] requests in flight from times[i] to times[i + 1] (events merged)."""
    t = np.concatenate([starts, ends])
    d = np.concatenate([np.ones(len(starts)), -np.ones(len(ends))])
    order = np.lexsort((d, t))  # at equal times, ends before starts
    times, c = t[order], np.cumsum(d[order])
    last = np.r_[times[1:] != times[:-1], True]  # the count after all events at one time
    return times[last], c[last]


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)]) if cum[-1] > 0 else 0.0


def steady_window(frame: pd.DataFrame) -> tuple[float, float] | str:
    """(start, end) of the steady window in run seconds, or why there is none."""
    if len(frame) < MIN_REQUESTS:
        return f"too few requests ({len(frame)} < {MIN_REQUESTS})"
    s = frame["start_s"].to_numpy(dtype=np.float64)
    e = frame["end_s"].fillna(frame["start_s"]).to_numpy(dtype=np.float64)
    times, c = in_flight(s, e)
    lo, hi = s.min(), s.max()
    if hi - lo < 0.1 * (e.max() - lo):  # a batch: in flight only falls after the sends
        return "no plateau: the requests were sent within the first tenth of the run"
    dur = np.diff(np.clip(times, lo, hi), append=hi)
    level = _weighted_median(c, np.clip(dur, 0.0, None))
    above = np.flatnonzero(c >= LEVEL_FRACTION * level)
    if level <= 0 or not len(above):
        return "no requests in flight"
    t0, t1 = float(times[above[0]]), float(times[min(above[-1] + 1, len(times) - 1)])
    started = int(((s >= t0) & (s < t1)).sum())
    if started < MIN_REQUESTS or t1 - t0 < MIN_SHARE * (e.max() - s.min()):
        return f"no plateau: {started} requests over {t1 - t0:.3g} s at >= {LEVEL_FRACTION:g} x {level:g} in flight"
    return t0, t1


def window_figures(frame: pd.DataFrame, t0: float, t1: float) -> dict[str, Any]:
    """Figures over [t0, t1): see the module doc. Keys without a prefix."""
    span = t1 - t0
    sent = frame[(frame["start_s"] >= t0) & (frame["start_s"] < t1)]
    done = sent[sent["ok"].astype(bool)]
    tokens = np.concatenate([np.asarray(t, dtype=np.float64) for t in frame["token_times"]] or [np.zeros(0)])
    ends = frame["end_s"].to_numpy(dtype=np.float64)
    s, e = frame["start_s"].to_numpy(dtype=np.float64), np.nan_to_num(ends, nan=t1)
    out: dict[str, Any] = {
        "duration_s": span, "requests": len(sent), "completed": len(done),
        "output_throughput": float(((tokens >= t0) & (tokens < t1)).sum() / span) if span > 0 else None,
        "request_throughput": float(((ends >= t0) & (ends < t1)).sum() / span) if span > 0 else None,
        "mean_in_flight": float(np.clip(np.minimum(e, t1) - np.maximum(s, t0), 0, None).sum() / span)
        if span > 0 else None,
    }  # fmt: skip
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        v = pd.to_numeric(done[key], errors="coerce").dropna().to_numpy()
        name = key.removesuffix("_ms")
        out[f"mean_{name}_ms"] = float(v.mean()) if len(v) else None
        for p in (50, 90, 99):
            out[f"p{p}_{name}_ms"] = float(np.percentile(v, p)) if len(v) else None
    return out


def steady_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """summary.json's `steady_*` figures (`steady_state` says why when there is no window)."""
    frame = request_frame(records)
    window = steady_window(frame)
    if isinstance(window, str):
        return {"steady_state": window}
    t0, t1 = window
    figs = window_figures(frame, t0, t1)
    return {"steady_state": "found", "steady_start_s": t0, "steady_end_s": t1,
            **{f"steady_{k}": v for k, v in figs.items()}}  # fmt: skip


def default_slice_s(frame: pd.DataFrame) -> float:
    """About ten slices over the run, rounded to 1, 2 or 5 x a power of ten seconds."""
    span = float(frame["end_s"].max() - frame["start_s"].min()) if len(frame) else 0.0
    if not np.isfinite(span) or span <= 0:
        return 1.0
    raw = span / 10
    base = 10 ** np.floor(np.log10(raw))
    return float(min((m * base for m in (1, 2, 5, 10)), key=lambda v: abs(v - raw)))


def time_slices(frame: pd.DataFrame, slice_s: float | None = None) -> pd.DataFrame:
    """One row per `slice_s` seconds from the first send: `window_figures` of each slice."""
    if frame.empty:
        return pd.DataFrame()
    step = slice_s or default_slice_s(frame)
    t_first = float(frame["start_s"].min())
    t_last = float(np.nanmax(frame["end_s"].to_numpy(dtype=np.float64)))
    n = int((t_last - t_first) // step) + 1  # the last slice holds the run's last event
    starts = t_first + step * np.arange(n)
    rows = [{"slice_start_s": float(a), **window_figures(frame, a, a + step)} for a in starts]
    return pd.DataFrame(rows)
