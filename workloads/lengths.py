"""Prompt / output length distributions, seeded and clamped to [min_len, max_len].

Every distribution samples with a caller-provided `numpy.random.Generator`, so a workload is
a pure function of its seed. `make_lengths(kind, **params)` builds one from config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd


class LengthDist(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n integer lengths (int64), each within the distribution's [min_len, max_len]."""
        ...


def _clamp(values: np.ndarray, min_len: int, max_len: int | None) -> np.ndarray:
    # values: [n] float or int -> [n] int64, rounded then clamped
    out = np.rint(values).astype(np.int64)
    return np.clip(out, min_len, max_len if max_len is not None else np.iinfo(np.int64).max)


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int
    min_len: int = 1
    max_len: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _clamp(np.full(n, self.value), self.min_len, self.max_len)


@dataclass(frozen=True, slots=True)
class Uniform:
    """Integers uniform on [low, high] inclusive."""

    low: int
    high: int
    min_len: int = 1
    max_len: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _clamp(rng.integers(self.low, self.high + 1, size=n), self.min_len, self.max_len)


@dataclass(frozen=True, slots=True)
class Normal:
    mean: float
    std: float
    min_len: int = 1
    max_len: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _clamp(rng.normal(self.mean, self.std, size=n), self.min_len, self.max_len)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Lognormal given by the median of the lengths and sigma of their logarithm."""

    median: float
    sigma: float
    min_len: int = 1
    max_len: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        vals = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return _clamp(vals, self.min_len, self.max_len)


@dataclass(frozen=True, slots=True)
class Empirical:
    """Resample (with replacement) observed lengths, e.g. a column of a trace CSV."""

    values: tuple[int, ...]
    min_len: int = 1
    max_len: int | None = None

    @classmethod
    def from_csv(cls, path: str | Path, column: str, min_len: int = 1, max_len: int | None = None) -> Empirical:
        col = pd.read_csv(path, usecols=[column])[column].dropna().astype(np.int64)
        if col.empty:
            raise ValueError(f"{path}: column {column!r} has no values")
        return cls(tuple(int(v) for v in col), min_len, max_len)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        pool = np.asarray(self.values, dtype=np.int64)
        return _clamp(pool[rng.integers(0, len(pool), size=n)], self.min_len, self.max_len)


_KINDS: dict[str, type] = {
    "fixed": Fixed,
    "uniform": Uniform,
    "normal": Normal,
    "lognormal": LogNormal,
}


def make_lengths(kind: str, **params: object) -> LengthDist:
    """Build a distribution from config: kind in fixed|uniform|normal|lognormal|empirical.

    `empirical` takes `path` and `column` (plus optional min_len / max_len).
    """
    if kind == "empirical":
        return Empirical.from_csv(**params)  # type: ignore[arg-type]
    if kind not in _KINDS:
        raise ValueError(f"unknown length distribution {kind!r}; expected one of {[*_KINDS, 'empirical']}")
    return _KINDS[kind](**params)
