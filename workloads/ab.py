"""`servelab-ab RUN_DIR a.overrides b.overrides`: two configurations on the same recorded traffic.

    servelab-ab runs/2026-12-01/10-00-00 a.txt b.txt --repeats 3
    servelab-ab RUN "scheduler.max_num_batched_tokens=64" "scheduler.max_num_batched_tokens=2048"

Each overrides argument is a file of `key=value` lines (`#` comments) or, when no such file
exists, the overrides themselves separated by spaces. Both configurations replay RUN_DIR
(`replay=RUN_DIR`: its arrivals, prompts and sampling settings) `--repeats` times, in ABBA
order (A B, B A, A B, ...) so slow drift of the machine falls on both. Per metric the statistic
is the median of the paired differences B - A (same request, same repeat): a burst of machine
noise that slows a few requests of one run moves a mean a long way and a median hardly at all.
Its interval is a cluster bootstrap (analysis/stats.py): repeats, then requests within each
repeat, so run-to-run drift (a busier machine during one repeat) widens the interval instead of
passing as an effect; with fewer than MIN_REPEATS (3) repeats there is no interval (two clusters
give a bootstrap only three distinct resamples: identical configurations came out +30% 'significant'). A difference is significant when
the interval excludes 0 and the relative effect (median difference / median of A) is at least
`--min-effect`. The table, ab.csv and ab.json go to `--out` with the run folders (a_0, b_0, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.stats import cluster_bootstrap, pooled_median

REQUEST_METRICS = ("ttft_ms", "tpot_ms", "e2el_ms")
RUN_METRICS = ("output_throughput", "request_throughput")
DEFAULTS = ["report.html=false"]  # per-run pages are not needed; a later override wins


@dataclass(frozen=True, slots=True)
class Difference:
    """B - A of one metric: the median paired difference, its interval, relative to A's median."""

    metric: str
    median_a: float
    median_b: float
    diff: float
    low: float  # nan with one repeat
    high: float
    n_pairs: int
    repeats: int
    significant: bool

    @property
    def relative(self) -> float:
        return self.diff / self.median_a if self.median_a else float("nan")


MIN_REPEATS = 3  # repeats needed for an interval (module doc)


def paired_difference(
    metric: str, pairs: list[tuple[np.ndarray, np.ndarray]], *, resamples: int = 2000, confidence: float = 0.95,
    min_effect: float = 0.05, seed: int = 0,
) -> Difference | None:
    """`pairs[k]` = (A values, B values) of repeat k, aligned by request; None without data."""
    pairs = [(np.asarray(a, float), np.asarray(b, float)) for a, b in pairs if len(a)]
    if not pairs:
        return None
    diffs = [b - a for a, b in pairs]
    median_a = float(np.median(np.concatenate([a for a, _ in pairs])))
    median_b = float(np.median(np.concatenate([b for _, b in pairs])))
    point = float(np.median(np.concatenate(diffs)))
    low = high = float("nan")
    if len(diffs) >= MIN_REPEATS:
        est = cluster_bootstrap([diffs], pooled_median, resamples=resamples, confidence=confidence, seed=seed)
        low, high = est.low, est.high
    effect = abs(point) / abs(median_a) if median_a else float("inf")
    significant = bool(low > 0 or high < 0) and effect >= min_effect
    return Difference(metric, median_a, median_b, point, low, high, sum(len(d) for d in diffs), len(diffs),
                      significant)  # fmt: skip


def read_overrides(arg: str) -> list[str]:
    try:
        is_file = Path(arg).is_file()
    except OSError:  # overrides longer than a file name can be
        is_file = False
    text = Path(arg).read_text() if is_file else arg
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        out.extend(line.split())
    return out


def run_one(run_dir: Path, recorded: Path, overrides: list[str]) -> Path:
    """One replay of `recorded` with `overrides` into `run_dir`; ValueError (one line) if it failed."""
    from conf.schema import RunConfig, compose_typed
    from workloads.experiment import run_experiment

    cfg = compose_typed(RunConfig, "run", [*DEFAULTS, *overrides, f"replay={recorded}"])
    outcome = run_experiment(cfg, run_dir)
    if outcome.error:
        raise ValueError(f"{run_dir.name}: {outcome.error}")
    return run_dir


def compare(a_runs: list[Path], b_runs: list[Path], *, min_effect: float, seed: int = 0) -> list[Difference]:
    """Per-metric paired differences B - A over the repeats (request metrics paired by id)."""
    from analysis.runfolder import read_requests, read_summary

    out = []
    frames = [(read_requests(a), read_requests(b)) for a, b in zip(a_runs, b_runs, strict=True)]
    for metric in REQUEST_METRICS:
        pairs = []
        for fa, fb in frames:
            fa, fb = fa[~fa["is_warmup"].astype(bool)], fb[~fb["is_warmup"].astype(bool)]
            joined = fa[["request_id", metric]].merge(fb[["request_id", metric]], on="request_id",
                                                      suffixes=("_a", "_b")).dropna()
            pairs.append((joined[f"{metric}_a"].to_numpy(), joined[f"{metric}_b"].to_numpy()))
        d = paired_difference(metric, pairs, min_effect=min_effect, seed=seed)
        if d is not None:
            out.append(d)
    summaries = [(read_summary(a), read_summary(b)) for a, b in zip(a_runs, b_runs, strict=True)]
    for metric in RUN_METRICS:
        pairs = [(np.array([sa[metric]]), np.array([sb[metric]])) for sa, sb in summaries
                 if sa.get(metric) is not None and sb.get(metric) is not None]
        d = paired_difference(metric, pairs, min_effect=min_effect, seed=seed)
        if d is not None:
            out.append(d)
    return out


def table(diffs: list[Difference]) -> pd.DataFrame:
    rows = [{**asdict(d), "relative": d.relative} for d in diffs]
    return pd.DataFrame(rows, columns=["metric", "median_a", "median_b", "diff", "low", "high", "relative",
                                       "n_pairs", "repeats", "significant"])


def run_ab(recorded: Path, a: list[str], b: list[str], out: Path, *, repeats: int = 3,
           min_effect: float = 0.05) -> pd.DataFrame:
    out.mkdir(parents=True, exist_ok=True)
    a_runs, b_runs = [], []
    for k in range(repeats):
        order = [("a", a, a_runs), ("b", b, b_runs)]
        for name, overrides, runs in order if k % 2 == 0 else order[::-1]:
            print(f"servelab-ab: repeat {k + 1}/{repeats}, {name.upper()}", flush=True)
            runs.append(run_one(out / f"{name}_{k}", recorded, overrides))
    df = table(compare(a_runs, b_runs, min_effect=min_effect))
    df.to_csv(out / "ab.csv", index=False)
    (out / "ab.json").write_text(json.dumps({
        "recorded_run": str(recorded), "a": a, "b": b, "repeats": repeats, "min_effect": min_effect,
        "order": "ABBA", "differences": df.to_dict("records"),
    }, indent=2, default=str))
    return df


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="servelab-ab", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a recorded run folder (its traffic is replayed)")
    p.add_argument("a", help="configuration A: an overrides file, or overrides separated by spaces")
    p.add_argument("b", help="configuration B: same form")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (ABBA order; 3 or more for an interval)")
    p.add_argument("--min-effect", type=float, default=0.05,
                   help="smallest relative difference called significant (default 0.05)")
    p.add_argument("--out", default=None, help="folder for the runs and ab.csv (default runs/ab/<time>)")
    args = p.parse_args(argv)
    from workloads.replay import check_run_dir

    try:
        recorded = check_run_dir(args.run_dir).resolve()
        out = Path(args.out or Path("runs") / "ab" / time.strftime("%Y-%m-%d_%H-%M-%S"))
        df = run_ab(recorded, read_overrides(args.a), read_overrides(args.b), out, repeats=args.repeats,
                    min_effect=args.min_effect)
    except (ValueError, OSError) as exc:
        print(f"servelab-ab: {exc}", file=sys.stderr)
        sys.exit(2)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"ab table: {out / 'ab.csv'}")


if __name__ == "__main__":
    main()
