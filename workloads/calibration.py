"""Calibration: fit the engine's `CalibratedStepModel` to the steps of real runs (steps.csv).

    step_time = intercept + sum_f coef_f * feature_f + sum_t table_t(feature_t)

`fit_step_model(steps_df)` fits on the rows of a run folder's steps.csv (one or several
runs concatenated) that did work. Default features: `num_prefill_tokens`,
`num_decode_tokens`, `num_decode_reqs`, and one KV-read feature: `num_kv_tokens_read`
(total context of the scheduled requests) when the csv has that column, else
`kv_blocks_used` (blocks in use: a proxy, which also counts blocks of running requests not
scheduled this step). Coefficients are non-negative (NNLS), which keeps the model physical
(more work never makes a step faster). Other features can be chosen explicitly, e.g.
`num_prefill_reqs` (a per-prompt-chunk cost), `is_mixed` (1 for a step holding both prompt
tokens and decodes) or `num_prefill_tokens_sq`; features that steps.csv lacks as a column are
derived from its columns (`DERIVED`).

Tables: a cost that is not linear in a feature is an interpolated `CostTable` (on this CPU
a step of 1, 2-3, 4-6, 7-9, 10-12, 13-15 tokens costs ~55, ~70, ~120, ~160, ~200, ~250 ms,
then ~170 ms at 16-20: blocked GEMM kernels, and a faster path from 16 rows). It is fitted
as segment slopes (clip(x - k_j, 0, k_{j+1} - k_j) per segment, max(0, x - k_last) after):
non-negative under NNLS, so the table never decreases (`monotone=True`), or signed (each
slope the difference of two non-negative ones) with `monotone=False` (but never after the
last knot). Knots are given, or chosen from the data (`auto_knots`).

The engine side (`engine/sim/calibrated.py`) only predicts step times and reads the saved
model; this module is the harness work over steps.csv columns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engine.sim.calibrated import CalibratedStepModel, CostTable

# Features steps.csv has no column for, computed from its columns.
DERIVED: dict[str, Callable[[Any], Any]] = {
    "num_tokens": lambda df: df["num_prefill_tokens"] + df["num_decode_tokens"],
    "num_reqs": lambda df: df["num_prefill_reqs"] + df["num_decode_reqs"],
    "is_mixed": lambda df: ((df["num_prefill_tokens"] > 0) & (df["num_decode_reqs"] > 0)).astype(float),
    "num_prefill_tokens_sq": lambda df: df["num_prefill_tokens"].astype(float) ** 2,
}
# Knot candidates of an automatic table: counts of requests or tokens, finer where small.
AUTO_KNOTS = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
              1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)  # fmt: skip
MIN_SEGMENT_ROWS = 5  # an automatic knot needs this many rows on each side up to the next knot
BASE_FEATURES = ("num_prefill_tokens", "num_decode_tokens", "num_decode_reqs")


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set).

    a: [m, n], b: [m] -> x: [n].
    """
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n):
        grad = a.T @ (b - a @ x)  # [n]
        if passive.all() or grad[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back towards x until a passive coefficient hits zero; drop it.
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def segment_basis(x: np.ndarray, knots: Sequence[float]) -> np.ndarray:
    """[rows] -> [rows, len(knots) + 1]: the part of x in each segment, then beyond the last knot."""
    edges = np.array([0.0, *knots])
    cols = [np.clip(x - lo, 0.0, hi - lo) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    cols.append(np.maximum(x - edges[-1], 0.0))
    return np.stack(cols, axis=1)


def table_from_slopes(knots: Sequence[float], slopes: Sequence[float]) -> CostTable:
    """Segment slopes (len(knots) + 1: one per segment, then the one after) -> table."""
    ys, y, prev = [], 0.0, 0.0
    for k, s in zip(knots, slopes, strict=False):
        y += float(s) * (k - prev)
        ys.append(y)
        prev = k
    return CostTable(tuple(float(k) for k in knots), tuple(ys), float(slopes[len(knots)]))


def auto_knots(
    x: np.ndarray, candidates: Sequence[float] = AUTO_KNOTS, min_rows: int = MIN_SEGMENT_ROWS
) -> list[float]:
    """Knots from `candidates` where the data supports them: below the largest value seen,
    each segment (and the part above the last knot) holding at least `min_rows` rows."""
    x = np.asarray(x, dtype=float)
    knots: list[float] = []
    prev = 0.0
    for k in candidates:
        if k >= x.max(initial=0.0):
            break
        if ((x > prev) & (x <= k)).sum() >= min_rows and (x > k).sum() >= min_rows:
            knots.append(float(k))
            prev = k
    return knots


def _feature_column(df: Any, name: str) -> np.ndarray:
    if name in df.columns:
        return df[name].to_numpy(dtype=float)
    if name in DERIVED:
        return np.asarray(DERIVED[name](df), dtype=float)
    raise KeyError(name)


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0


def default_features(steps_df: Any) -> list[str]:
    """Prefill tokens, decode tokens and requests, one KV feature; collinear duplicates dropped.

    Without speculative decoding every decode request schedules one token, so
    num_decode_tokens equals num_decode_reqs and only the first of the two is kept.
    """
    columns = list(steps_df.columns)
    kv = "num_kv_tokens_read" if "num_kv_tokens_read" in columns else "kv_blocks_used"
    chosen: list[str] = []
    for name in (*BASE_FEATURES, kv):
        if name in columns and any(c in columns and steps_df[name].equals(steps_df[c]) for c in chosen):
            continue
        chosen.append(name)
    return chosen


def fit_step_model(
    steps_df: Any,
    features: Sequence[str] | None = None,
    time_column: str = "step_time",
    *,
    tables: Mapping[str, Sequence[float]] | None = None,
    robust: bool = False,
    monotone: bool = True,
) -> CalibratedStepModel:
    """Fit on the rows of `steps_df` (a pandas DataFrame of steps.csv) that did work.

    `features` enter linearly (default: `default_features`, less any feature given a
    table); `tables` maps a feature to its knots (empty: `auto_knots` from the data).
    `robust`: iteratively reweighted (Huber, threshold 1.345 robust sigma), so steps
    slowed by something else (a page fault, another process) weigh less.
    `monotone`: tables never decrease (non-negative segment slopes); False lets a
    table fall where the data does (a CPU switching to a faster kernel at larger sizes),
    except beyond its last knot.
    Rows with no scheduled token are dropped. Columns are scaled before the NNLS so
    the fit is well conditioned. Raises ValueError on missing columns or no rows (and,
    from the model, on features it does not know).
    """
    tables = dict(tables or {})
    if features is None:
        features = [f for f in default_features(steps_df) if f not in tables]
    features = list(features)
    needed = {time_column, *features, *tables}
    missing = {c for c in needed if c not in steps_df.columns and c not in DERIVED}
    if missing:
        raise ValueError(f"steps table lacks columns {sorted(missing)}")
    df = steps_df
    if {"num_prefill_tokens", "num_decode_tokens"} <= set(df.columns):
        df = df[df["num_prefill_tokens"] + df["num_decode_tokens"] > 0]
    if len(df) == 0:
        raise ValueError("no step with scheduled tokens to fit")
    try:
        cols = [_feature_column(df, f) for f in features]  # each [rows]
        table_x = {name: _feature_column(df, name) for name in tables}
    except KeyError as e:  # a derived feature whose source column is absent
        raise ValueError(f"steps table lacks columns [{e}]") from None
    knots = {name: list(k) if k else auto_knots(table_x[name]) for name, k in tables.items()}
    blocks = [np.ones((len(df), 1)), *(c[:, None] for c in cols)]
    for name in tables:
        basis = segment_basis(table_x[name], knots[name])  # [rows, len(knots) + 1]
        # Signed slopes as the difference of two non-negative ones; the slope after the
        # last knot stays non-negative (extrapolated costs never shrink to nothing).
        blocks += [basis] if monotone else [basis, -basis[:, :-1]]
    a = np.hstack(blocks)  # [rows, 1 + features + sum(len(knots) + 1)]
    y = df[time_column].to_numpy(dtype=float)  # [rows]
    sol = _weighted_nnls(a, y, robust)
    r2 = _r2(y, a @ sol)
    n = 1 + len(features)
    coefs = {name: float(c) for name, c in zip(features, sol[1:n], strict=True)}
    fitted: dict[str, CostTable] = {}
    for name in tables:
        m = len(knots[name]) + 1
        slopes = sol[n : n + m]
        if not monotone:
            slopes = slopes - np.append(sol[n + m : n + 2 * m - 1], 0.0)
            n += m - 1
        n += m
        if knots[name]:
            fitted[name] = table_from_slopes(knots[name], slopes)
        else:  # no knot: the table is a line through 0
            coefs[name] = coefs.get(name, 0.0) + float(slopes[0])
    return CalibratedStepModel(float(sol[0]), coefs, r2=r2, num_samples=len(df), tables=fitted)


def _weighted_nnls(a: np.ndarray, y: np.ndarray, robust: bool) -> np.ndarray:
    """NNLS on column-scaled `a` ([rows, columns]); `robust`: Huber-reweighted, up to 8 rounds."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    w = np.ones(len(y))
    for _ in range(8 if robust else 1):
        sw = np.sqrt(w)[:, None]
        sol = nnls(a / scale * sw, y * sw[:, 0]) / scale  # [columns]
        if not robust:
            break
        resid = y - a @ sol
        sigma = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
        if sigma <= 0:
            break
        k = 1.345 * sigma
        new_w = np.minimum(1.0, k / np.maximum(np.abs(resid), 1e-300))
        if np.allclose(new_w, w, atol=1e-3):
            break
        w = new_w
    return sol
