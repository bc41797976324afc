"""A trace's arrival process: what `servelab-trace analyze` reports of it and how `synthesize`
draws new arrival times like it.

Why more than a gamma fit. Many traces write coarse timestamps: whole seconds (BurstGPT), or a
batch of requests logged under one time every few seconds. Most gaps are then 0 and the rest
sit on a grid; a gamma fitted to the positive gaps only (a gamma has no zeros) sees nearly
equal gaps and reports a shape near 1e7, "more regular than Poisson", though the gaps' CV is
3, and arrival times drawn from it are evenly spaced: every TTFT measured on such a copy is too
good. So the analysis says what the timestamps can tell:

- `resolution_s`: the grid the timestamps sit on (the largest step every positive gap is a
  whole multiple of, within 1% of a step), None when they are continuous;
- `tied_share`: the share of gaps that are 0 (a request logged at the same time as the one
  before); from `TIED_SHARE` on, the requests that share a time are the arrival process's
  events (`batches`): their sizes and the gaps between them;
- `dispersion`: the index of dispersion (variance / mean) of the request counts per window at
  a few window widths from the grid step (or the mean gap) up: 1 for Poisson at every width,
  above 1 bursty, below 1 regular. Counts per window need no gap below the resolution;
- `gamma_describes_gaps`: whether a gamma fits the gaps at all: False when `TIED_SHARE` or more
  are 0, or when the fitted gamma's CV (1/sqrt(shape)) is more than `CV_TOLERANCE` from the
  gaps' own; `gamma_note` says which, with the numbers.

`synthesize_arrivals` draws from what describes the source (`arrival_model`):
- "batches" (ties from `TIED_SHARE` on): batch sizes and the gaps between batches, each a
  stratified draw (Latin hypercube over the quantiles) of the source's own values, the gaps
  divided by the rate scale. Requests that shared a time in the source share one in the copy:
  the trace cannot say how they spread inside a tick, and a replay of the source sends them
  together too, so copy and source load a server alike;
- "gamma" (the fit describes the gaps): stratified draws of the fitted gamma (its shape, the
  mean gap divided by the rate scale);
- "empirical gaps" (neither): stratified draws of the source's own gaps, divided by the scale.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats

TIED_SHARE = 0.05  # share of zero gaps from which a trace's arrivals are batches
CV_TOLERANCE = 0.25  # |gamma CV / gaps' CV - 1| up to which a gamma describes the gaps
GRID_TOLERANCE = 0.01  # how far from a whole number of grid steps a gap may be (in steps)
MAX_GRID_DIVISOR = 10  # the grid step is the smallest positive gap / k for some k <= this
DISPERSION_SCALES = (1, 10, 100)  # window widths, in grid steps (or mean gaps)
MIN_WINDOWS = 10  # a dispersion figure needs at least this many windows in the span


def gamma_shape(gaps: np.ndarray) -> tuple[float, float, int]:
    """(shape, scale, zero gaps) of gamma.fit(gaps > 0, floc=0); NaN shape under 2 positive gaps,
    an infinite one (scale 0) when the positive gaps are all equal (the fit has no optimum)."""
    pos = gaps[gaps > 0]
    zeros = int(len(gaps) - len(pos))
    if len(pos) < 2:
        return float("nan"), float("nan"), zeros
    if np.ptp(pos) <= 1e-9 * pos.mean():
        return float("inf"), 0.0, zeros
    shape, _, scale = stats.gamma.fit(pos, floc=0)
    return float(shape), float(scale), zeros


def timestamp_resolution(ts: np.ndarray) -> float | None:
    """The grid step of sorted times `ts` (see the module doc); None when continuous."""
    pos = np.diff(ts)
    pos = pos[pos > 0]
    if len(pos) < 2:
        return None
    smallest = float(pos.min())
    for k in range(1, MAX_GRID_DIVISOR + 1):  # gaps of 2 s and 3 s sit on a 1 s grid
        step = smallest / k
        units = pos / step
        if np.all(np.abs(units - np.round(units)) <= GRID_TOLERANCE):
            return step
    return None


def batches(ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct times, requests at each) of sorted times `ts`."""
    times, sizes = np.unique(ts, return_counts=True)
    return times, sizes


def index_of_dispersion(ts: np.ndarray, width_s: float) -> float:
    """Variance / mean of the request counts in windows of `width_s` from the first arrival
    (the last, partial window left out); NaN with fewer than `MIN_WINDOWS` whole windows."""
    span = float(ts[-1] - ts[0]) if len(ts) else 0.0
    whole = int(span // width_s) if width_s > 0 else 0
    if whole < MIN_WINDOWS:
        return float("nan")
    counts = np.bincount(((ts - ts[0]) // width_s).astype(np.int64), minlength=whole + 1)[:whole]
    mean = counts.mean()
    return float(counts.var() / mean) if mean > 0 else float("nan")


def gamma_verdict(gaps: np.ndarray, shape: float) -> tuple[bool, str]:
    """(whether a gamma of `shape` describes `gaps`, one line saying why or why not)."""
    if len(gaps) < 2 or np.isnan(shape):
        return False, "too few positive gaps to fit a gamma"
    tied = float(np.mean(gaps == 0))
    if tied >= TIED_SHARE:
        return False, (f"{tied:.0%} of the gaps are 0 (requests sharing a timestamp) and a gamma has none: "
                       f"its shape {shape:.3g}, fitted to the positive gaps only, says nothing of the bursts")  # fmt: skip
    cv, gamma_cv = float(gaps.std() / gaps.mean()), 1.0 / np.sqrt(shape)
    if abs(gamma_cv - cv) > CV_TOLERANCE * cv:
        return False, f"a gamma of shape {shape:.3g} has CV {gamma_cv:.2f}; the gaps' CV is {cv:.2f}"
    return True, f"the gamma's CV {gamma_cv:.2f} matches the gaps' {cv:.2f}"


def arrival_model(tied_share: float, gamma_describes: bool) -> str:
    """What `synthesize_arrivals` draws from (see the module doc)."""
    if tied_share >= TIED_SHARE:
        return "batches"
    return "gamma" if gamma_describes else "empirical gaps"


def _summary(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0, "cv": 0.0}
    mean = float(values.mean())
    return {"mean": mean, "p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
            "max": float(values.max()), "cv": float(values.std() / mean) if mean > 0 else 0.0}  # fmt: skip


def arrival_stats(ts: np.ndarray, window_s: float) -> dict[str, Any]:
    """The arrival figures of sorted times `ts` (s): mean rate, rate per `window_s` window, the
    gaps' CV and gamma fit, and the module doc's resolution, batches, dispersion and verdict."""
    span = float(ts[-1] - ts[0]) if len(ts) > 1 else 0.0
    gaps = np.diff(ts)
    shape, scale, zeros = gamma_shape(gaps)
    edges = np.arange(0.0, span + window_s, window_s) if span > 0 else np.array([0.0, window_s])
    counts, _ = np.histogram(ts - ts[0], bins=edges) if len(ts) else (np.zeros(1), None)
    rates = (counts / window_s).tolist()
    resolution = timestamp_resolution(ts)
    tied = float(zeros / len(gaps)) if len(gaps) else 0.0
    times, sizes = batches(ts)
    describes, note = gamma_verdict(gaps, shape)
    model = arrival_model(tied, describes)
    base = resolution if resolution is not None and model == "batches" else (span / len(gaps) if len(gaps) else 0.0)
    dispersion = []
    for k in DISPERSION_SCALES:
        iod = index_of_dispersion(ts, base * k) if base > 0 else float("nan")
        if np.isfinite(iod):
            dispersion.append({"window_s": base * k, "index_of_dispersion": iod})
    return {
        "span_s": span,
        "rate": (len(ts) - 1) / span if span > 0 else 0.0,  # gaps per second = 1 / mean gap
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else 0.0,
        "gamma_shape": shape,
        "gamma_scale_s": scale,
        "gamma_describes_gaps": describes,
        "gamma_note": note,
        "zero_gaps": zeros,
        "resolution_s": resolution,
        "tied_share": tied,
        "batches": {"count": len(times), "size": _summary(sizes.astype(np.float64)),
                    "gap_s": _summary(np.diff(times))},  # fmt: skip
        "dispersion": dispersion,
        "arrival_model": model,
        "window_s": window_s,
        "rate_per_window": rates,
        "window_rate_min": float(min(rates)) if rates else 0.0,
        "window_rate_max": float(max(rates)) if rates else 0.0,
    }


def _stratified(n: int, rng: np.random.Generator) -> np.ndarray:
    """n probabilities, one from each of n equal strata, in random order."""
    return (rng.permutation(n) + rng.random(n)) / n


def _stratified_gamma(shape: float, mean_gap: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n gamma gaps with the given shape and mean (the sample's mean and shape stay close to the
    target's at any n); an infinite shape is a constant gap."""
    if np.isinf(shape):
        return np.full(n, mean_gap)
    return stats.gamma.ppf(_stratified(n, rng), shape, scale=mean_gap / shape)


def _stratified_values(values: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n of the source's own `values` (stratified over their quantiles: each is one of them)."""
    return np.quantile(values, _stratified(n, rng), method="inverted_cdf")


def _batch_times(times: np.ndarray, sizes: np.ndarray, n: int, rate_scale: float,
                 rng: np.random.Generator) -> np.ndarray:  # fmt: skip
    """n arrival times in batches: sizes and gaps between batches drawn from the source's."""
    count = max(1, int(np.ceil(n / sizes.mean())))
    drawn = _stratified_values(sizes, count, rng).astype(np.int64)
    while drawn.sum() < n:  # the strata's sizes fell short: more batches, drawn plainly
        drawn = np.append(drawn, rng.choice(sizes))
    drawn = drawn[: int(np.searchsorted(np.cumsum(drawn), n)) + 1]
    drawn[-1] -= int(drawn.sum() - n)  # the last batch cut to make n
    gaps = _stratified_values(np.diff(times), len(drawn) - 1, rng) / rate_scale
    starts = np.concatenate([[0.0], np.cumsum(gaps)])
    return np.repeat(starts, drawn)


def synthesize_arrivals(ts: np.ndarray, n: int, rate_scale: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times (from 0) like sorted source times `ts`, at `rate_scale` times its rate,
    drawn from its `arrival_model` (module doc)."""
    if n < 2 or len(ts) < 2:
        return np.zeros(n)
    arr = arrival_stats(ts, 60.0)
    gaps = np.diff(ts)
    if arr["arrival_model"] == "batches":
        times, sizes = batches(ts)
        if len(times) >= 2:
            return _batch_times(times, sizes, n, rate_scale, rng)
    mean_gap = 1.0 / (arr["rate"] * rate_scale) if arr["rate"] > 0 else 1.0
    if arr["arrival_model"] == "gamma":
        drawn = _stratified_gamma(arr["gamma_shape"], mean_gap, n - 1, rng)
    else:
        drawn = _stratified_values(gaps, n - 1, rng) / rate_scale
    return np.concatenate([[0.0], np.cumsum(drawn)])
