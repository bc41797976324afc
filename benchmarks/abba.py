"""Two sides measured in alternation on one machine, and their rounds compared by rank.

`abba_rounds` runs `rounds` rounds of each side in ABBA order (A B, B A, A B, ...), so a drift of a
shared machine falls on both; `rank_compare` gives the two medians, their ratio, a two-sided
Mann-Whitney U p-value and a printable line; a comparison is `flagged` when the medians differ by
more than a tolerance while the rounds are told apart (p < alpha). With n rounds a side the
smallest two-sided p is 2 / C(2n, n): 0.029 at 4, 0.008 at 5, so fewer than 4 rounds a side can
never flag at alpha 0.05.

Used by benchmarks/vllm_keys_agreement.py and benchmarks/client_clock_agreement.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def abba_rounds(first: tuple[str, Callable[[], T]], second: tuple[str, Callable[[], T]], rounds: int,
                progress: bool = True) -> tuple[list[T], list[T]]:  # fmt: skip
    """`rounds` results of each side, run in ABBA order; a progress line on stderr per run."""
    results: dict[str, list[T]] = {first[0]: [], second[0]: []}
    for k in range(rounds):
        for name, run in (first, second) if k % 2 == 0 else (second, first):
            results[name].append(run())
            if progress:
                print(f"  round {k + 1}/{rounds}: {name} done", file=sys.stderr, flush=True)
    return results[first[0]], results[second[0]]


@dataclass(frozen=True)
class RankComparison:
    key: str
    a: tuple[float, ...]
    b: tuple[float, ...]
    ratio: float  # median(a) / median(b)
    p: float  # two-sided Mann-Whitney U

    def flagged(self, tolerance: float, alpha: float) -> bool:
        """The medians differ by more than `tolerance` and the rounds are told apart."""
        return abs(self.ratio - 1) > tolerance and self.p < alpha

    def line(self, label_a: str, label_b: str, digits: int = 3) -> str:
        return (f"{self.key}: {label_a} {statistics.median(self.a):.{digits}f} vs {label_b} "
                f"{statistics.median(self.b):.{digits}f} ({self.ratio - 1:+.1%}, Mann-Whitney p={self.p:.3f}) rounds "
                f"{[round(x, digits) for x in self.a]} / {[round(x, digits) for x in self.b]}")  # fmt: skip


def rank_compare(key: str, a: Sequence[float], b: Sequence[float]) -> RankComparison:
    from scipy.stats import mannwhitneyu

    ratio = statistics.median(a) / statistics.median(b)
    p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
    return RankComparison(key, tuple(a), tuple(b), ratio, p)


def rounds_args(doc: str | None, default_rounds: int, argv: list[str] | None) -> argparse.Namespace:
    """The command line both agreement benchmarks take: `--rounds N` (at least 2: a rank test needs
    rounds on both sides) and `--json OUT`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=default_rounds, help=f"rounds per client (default {default_rounds})")
    ap.add_argument("--json", type=Path, help="write every round's figures and the comparison here")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (a rank test needs rounds on both sides)")
    return args
