"""Calibrated step-time model: a non-negative linear fit to the steps of real runs.

    step_time = intercept + sum_f coef_f * feature_f

Features are `StepBatch` aggregates that a run's steps.csv also records:
`num_prefill_tokens`, `num_decode_tokens`, `num_decode_reqs`, and one KV-read feature:
`num_kv_tokens_read` (total context of the scheduled requests) when the csv has that
column, else `kv_blocks_used` (blocks in use: a proxy, which also counts blocks of running
requests not scheduled this step). Coefficients are seconds per unit; non-negativity
keeps the model physical (more work never makes a step faster). Other features can be
chosen explicitly, e.g. `num_prefill_reqs` (a per-prompt-chunk cost).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from engine.sim.step_batch import StepBatch

# steps.csv column -> how to read it off a StepBatch.
FEATURES: dict[str, str] = {
    "num_prefill_tokens": "num_prefill_tokens",
    "num_decode_tokens": "num_decode_tokens",
    "num_decode_reqs": "num_decode_reqs",
    "num_prefill_reqs": "num_prefill_reqs",
    "num_kv_tokens_read": "kv_tokens_read",
    "kv_blocks_used": "kv_blocks",
    "num_attn_pairs": "attn_pairs",
    "num_tokens": "num_tokens",
}
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


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0


@dataclass
class CalibratedStepModel:
    """step_time = intercept + sum coefs[f] * f(batch); see the module docstring."""

    intercept: float
    coefs: dict[str, float]
    r2: float = float("nan")
    num_samples: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefs) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
        self._terms = [(FEATURES[name], c) for name, c in self.coefs.items() if c]

    # ---- StepModel ----------------------------------------------------------------
    def step_time(self, batch: StepBatch) -> float:
        if batch.num_tokens == 0:
            return 0.0
        return self.intercept + sum(c * getattr(batch, attr) for attr, c in self._terms)

    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        if batch.num_tokens == 0:
            return {}
        parts = {"intercept": self.intercept}
        parts.update({name: c * getattr(batch, FEATURES[name]) for name, c in self.coefs.items()})
        return parts

    # ---- fitting ------------------------------------------------------------------
    @staticmethod
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

    @classmethod
    def fit(
        cls, steps_df: Any, features: Sequence[str] | None = None, time_column: str = "step_time"
    ) -> CalibratedStepModel:
        """Fit on the rows of `steps_df` (a pandas DataFrame of steps.csv) that did work.

        Rows with no scheduled token are dropped. Columns are scaled before the NNLS so
        the fit is well conditioned. Raises ValueError on missing columns or no rows.
        """
        features = list(features or cls.default_features(steps_df))
        missing = {time_column, *features} - set(steps_df.columns)
        if missing:
            raise ValueError(f"steps table lacks columns {sorted(missing)}")
        df = steps_df
        if {"num_prefill_tokens", "num_decode_tokens"} <= set(df.columns):
            df = df[df["num_prefill_tokens"] + df["num_decode_tokens"] > 0]
        if len(df) == 0:
            raise ValueError("no step with scheduled tokens to fit")
        x = df[features].to_numpy(dtype=float)  # [rows, features]
        y = df[time_column].to_numpy(dtype=float)  # [rows]
        a = np.hstack([np.ones((len(df), 1)), x])  # [rows, 1 + features]
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        sol = nnls(a / scale, y) / scale  # [1 + features]
        r2 = _r2(y, a @ sol)
        coefs = {name: float(c) for name, c in zip(features, sol[1:], strict=True)}
        return cls(float(sol[0]), coefs, r2=r2, num_samples=len(df))

    # ---- files --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "calibrated",
            "intercept": self.intercept,
            "coefs": dict(self.coefs),
            "r2": None if np.isnan(self.r2) else self.r2,
            "num_samples": self.num_samples,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        """As JSON (`.json`) or YAML (any other suffix)."""
        path = Path(path)
        d = self.to_dict()
        path.write_text(
            json.dumps(d, indent=2) if path.suffix == ".json" else yaml.safe_dump(d, sort_keys=False)
        )

    @classmethod
    def load(cls, path: str | Path) -> CalibratedStepModel:
        d = yaml.safe_load(Path(path).read_text())  # reads JSON too
        if d.get("kind") != "calibrated":
            raise ValueError(f"{path} is not a calibrated step model (kind={d.get('kind')!r})")
        r2 = d.get("r2")
        return cls(
            d["intercept"],
            d["coefs"],
            float("nan") if r2 is None else r2,
            d.get("num_samples", 0),
            d.get("meta", {}),
        )
