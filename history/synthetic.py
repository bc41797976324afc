"""Synthetic histories at the gate's noise level, and how the change-point search does on them.

`python -m history.synthetic --seeds 100` prints the table in docs/history.md: 60 commits of
CPU time per token with steps of +8% (at commit 20) and +15% (at commit 40), or none, noise
drawn at the level the paired gate measures between identical commits on this machine (the
spread of its estimates in benchmarks/gate_power_*.jsonl), Gaussian and heavy-tailed.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from history.ingest import Measurement, Record, digest
from history.machine import Commit, Machine

if TYPE_CHECKING:  # the change-point search (ruptures, pandas) only for evaluate(): writers in tests start fast
    from history.changes import Settings

POWER_RUNS = Path(__file__).resolve().parents[1] / "benchmarks" / "gate_power_2026-12-05.jsonl"
STEPS = ((20, 0.08), (40, 0.15))  # (first commit of the new level, relative step over the level before)


def gate_noise(path: Path = POWER_RUNS) -> float:
    """The standard deviation of the paired gate's CPU-time-per-token estimate about the truth:
    its estimates minus the slowdown injected, over every run of a power measurement."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    errors = [r["cpu_change"] - r["slowdown"] for r in rows if r.get("cpu_change") is not None]
    if len(errors) < 10:
        raise ValueError(f"{path}: too few gate runs to estimate the noise ({len(errors)})")
    return float(np.std(errors, ddof=1))


def history(n: int, sigma: float, steps: tuple[tuple[int, float], ...], rng: np.random.Generator,
            tails: str = "gaussian", base: float = 2.0) -> np.ndarray:  # fmt: skip
    """`n` commits' values: `base` with multiplicative `steps`, times 1 + noise of sd `sigma`."""
    level = np.full(n, base)
    for at, step in steps:
        level[at:] *= 1 + step
    if tails == "gaussian":
        noise = rng.normal(0.0, sigma, n)
    else:  # Student's t with 3 degrees of freedom scaled to sd sigma: a burst now and then
        noise = rng.standard_t(3, n) * sigma / np.sqrt(3.0)
    return level * (1 + noise)


TEST_MACHINE = Machine("Synthetic CPU @ 2.0GHz", ("avx2", "fma"), 2, "x86_64")


def synthetic_records(values: np.ndarray, metric: str = "cpu_ms_per_token", machine: Machine = TEST_MACHINE,
                      config: str = "synthetic", t0: float = 1.7e9, tag: str = "") -> list[Record]:  # fmt: skip
    """One gate-like record per value, commit i at time t0 + i hours (fake shas, no git needed)."""
    out = []
    for i, v in enumerate(values):
        sha = digest([tag, config, i], 40)
        c = Commit(sha, t0 + 3600 * i, f"synthetic commit {i}")
        m = Measurement(sha, c.time, "candidate", metric, float(v), direction="lower")
        out.append(Record("gate", digest([tag, machine.fingerprint, config, metric, i, float(v)], 64), c, machine,
                          {"torch": "0", "engine": "0", "python": "3"}, digest(config), config, [m],
                          verdict="pass"))  # fmt: skip
    return out


@dataclass
class Row:
    noise: str
    series: int
    both_exact: int
    both_within_1: int
    false_alarms: int  # change points not within 1 commit of a true step
    noise_only_series_with_any: int
    seconds_per_series: float

    def cells(self) -> list[str]:
        return [self.noise, str(self.series), f"{self.both_exact}/{self.series}", f"{self.both_within_1}/{self.series}",
                str(self.false_alarms), f"{self.noise_only_series_with_any}/{self.series}",
                f"{self.seconds_per_series:.2f}"]  # fmt: skip


def evaluate(sigma: float, tails: str, seeds: int, settings: Settings, n: int = 60) -> Row:
    from history.changes import find_splits
    exact = within = false = noise_any = 0
    t0 = time.perf_counter()
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        found = [s.index for s in find_splits(history(n, sigma, STEPS, rng, tails), settings)]
        truth = [at for at, _ in STEPS]
        exact += all(t in found for t in truth)
        within += all(any(abs(f - t) <= 1 for f in found) for t in truth)
        false += sum(not any(abs(f - t) <= 1 for t in truth) for f in found)
        noise_any += bool(find_splits(history(n, sigma, (), rng, tails), settings))
    per = (time.perf_counter() - t0) / (2 * seeds)
    label = f"{tails}, sd {sigma:.2%}"
    return Row(label, seeds, exact, within, false, noise_any, per)


def main(argv: list[str] | None = None) -> int:
    from history.changes import Settings

    parser = argparse.ArgumentParser(prog="python -m history.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="series of each kind (default: %(default)s)")
    parser.add_argument("--noise-scale", type=float, nargs="*", default=[1.0, 2.0],
                        help="multiples of the gate's noise to try (default: 1 2)")
    args = parser.parse_args(argv)
    sigma = gate_noise()
    print(f"gate noise (sd of CPU time per token estimates, {POWER_RUNS.name}): {sigma:.2%}")
    head = ["noise", "series", "both steps at the exact commit", "both within 1 commit", "other change points",
            "noise-only series with any change point", "s per series"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for scale in args.noise_scale:
        for tails in ("gaussian", "t3"):
            print("| " + " | ".join(evaluate(sigma * scale, tails, args.seeds, Settings()).cells()) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
