"""Calibrated step-time model: step times predicted from a fit to the steps of real runs.

    step_time = intercept + sum_f coef_f * feature_f + sum_t table_t(feature_t)

Features are `StepBatch` aggregates that a run's steps.csv also records (`FEATURES` maps
each steps.csv column name to the `StepBatch` attribute it is read from): e.g.
`num_prefill_tokens`, `num_decode_tokens`, `num_decode_reqs`, `num_kv_tokens_read`,
`kv_blocks_used`, `num_prefill_reqs`, `is_mixed`, `num_prefill_tokens_sq`. Coefficients are
seconds per unit, non-negative when fitted (more work never makes a step faster).

Tables: a cost that is not linear in a feature is an interpolated table `table_t`,
piecewise linear through knots (x, y), starting at (0, 0), with a slope after the last knot.
Saved files without `tables` load as before (a plain linear model).

This module only predicts and reads/writes the model files; the fit over steps.csv columns
lives on the workbench side (`workloads/calibration.py`, `fit_step_model`).
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Mapping
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
    "num_reqs": "num_reqs",
    "is_mixed": "is_mixed",
    "num_prefill_tokens_sq": "prefill_tokens_sq",
}


@dataclass(frozen=True)
class CostTable:
    """Piecewise-linear, non-decreasing cost of one feature: through (0, 0) and the knots
    (xs[i], ys[i]), `slope_after` beyond the last knot. Seconds."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    slope_after: float = 0.0

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or not self.xs:
            raise ValueError("a cost table needs as many ys as xs, at least one knot")
        if any(b <= a for a, b in zip((0.0, *self.xs), self.xs, strict=False)):
            raise ValueError(f"table knots must be positive and increasing, got {list(self.xs)}")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] + self.slope_after * (x - xs[-1])
        if x <= 0:
            return 0.0
        i = bisect_right(xs, x)  # xs[i-1] <= x < xs[i]
        x0, y0 = (xs[i - 1], ys[i - 1]) if i else (0.0, 0.0)
        return y0 + (ys[i] - y0) * (x - x0) / (xs[i] - x0)

    def to_dict(self) -> dict[str, Any]:
        return {"x": list(self.xs), "y": list(self.ys), "slope_after": self.slope_after}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostTable:
        return cls(
            tuple(float(v) for v in d["x"]), tuple(float(v) for v in d["y"]), float(d.get("slope_after", 0.0))
        )


@dataclass
class CalibratedStepModel:
    """step_time = intercept + sum coefs[f] * f(batch); see the module docstring."""

    intercept: float
    coefs: dict[str, float]
    r2: float = float("nan")
    num_samples: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, CostTable] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = (set(self.coefs) | set(self.tables)) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
        self.tables = {
            k: t if isinstance(t, CostTable) else CostTable.from_dict(t) for k, t in self.tables.items()
        }
        self._terms = [(FEATURES[name], c) for name, c in self.coefs.items() if c]
        self._tables = [(FEATURES[name], t) for name, t in self.tables.items()]

    # ---- StepModel ----------------------------------------------------------------
    def step_time(self, batch: StepBatch) -> float:
        if batch.num_tokens == 0:
            return 0.0
        t = self.intercept + sum(c * getattr(batch, attr) for attr, c in self._terms)
        for attr, table in self._tables:
            t += table(getattr(batch, attr))
        return t

    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        if batch.num_tokens == 0:
            return {}
        parts = {"intercept": self.intercept}
        parts.update({name: c * getattr(batch, FEATURES[name]) for name, c in self.coefs.items()})
        for name, table in self.tables.items():
            parts[f"table:{name}"] = table(getattr(batch, FEATURES[name]))
        return parts

    def describe(self) -> str:
        """One line: intercept, coefficients and tables in ms."""
        parts = [f"intercept {self.intercept * 1e3:.2f} ms"]
        parts += [f"{k} {v * 1e3:.4f} ms" for k, v in self.coefs.items()]
        for name, t in self.tables.items():
            pts = " ".join(f"{x:g}:{y * 1e3:.1f}" for x, y in zip(t.xs, t.ys, strict=True))
            parts.append(f"{name} table [{pts}] ms, then {t.slope_after * 1e3:.2f} ms/unit")
        return ", ".join(parts) + f", R^2 {self.r2:.3f}"

    # ---- files --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "calibrated",
            "intercept": self.intercept,
            "coefs": dict(self.coefs),
            "r2": None if np.isnan(self.r2) else self.r2,
            "num_samples": self.num_samples,
            "meta": self.meta,
        } | ({"tables": {k: t.to_dict() for k, t in self.tables.items()}} if self.tables else {})

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
            {k: CostTable.from_dict(t) for k, t in (d.get("tables") or {}).items()},
        )
