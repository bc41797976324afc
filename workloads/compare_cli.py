"""`servelab-compare`: two run folders side by side, or their change explained, or (`--runs N`)
one or two configurations run N times each first.

The command sits on the workloads side because `--runs` runs servelab-run
(workloads/compare_runs.py); comparing folders already on disk, and `--explain`, are the
reports' (reports/cli.py `compare_folders`, `compare_explain`). Exit codes as reports/cli.py's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from reports.cli import compare_explain, compare_folders, guard
from reports.compare import compare, format_table, write_html
from reports.gate import load_gate_config


def _compare(args: argparse.Namespace) -> int:
    if args.runs is not None:
        return _compare_runs(args)
    if getattr(args, "explain", False):
        if args.b is None:
            raise ValueError("--explain: give two run folders")
        return compare_explain(args)
    if args.b is None:
        raise ValueError("give two run folders (or --runs N with one or two configurations)")
    return compare_folders(args)


def _compare_runs(args: argparse.Namespace) -> int:
    """--runs N: run the configuration(s) N times each, then a repeatability table or a comparison."""
    from workloads import compare_runs

    out = Path(args.out) if args.out else compare_runs.default_out()
    sides = compare_runs.run_configurations(compare_runs.configurations(args.a, args.b), args.runs, out)
    if len(sides) == 1:
        df = compare_runs.repeatability(sides[0])
    else:
        df = compare(sides[0], sides[1], load_gate_config(args.config))
    print(format_table(df))
    df.to_csv(out / "compare.csv", index=False)
    print(f"compare table: {out / 'compare.csv'}")
    if args.html and len(sides) == 2:
        print(write_html(df, sides[0], sides[1], args.html))
    return 0


def compare_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="servelab-compare",
        description="Compare the summary metrics of two runs, or (--runs N) run one or two configurations N times "
        "each and report their spread or compare them.",
    )
    parser.add_argument("a", help="run folder A (or a folder of repeated runs); with --runs, configuration A: "
                        "an overrides file or overrides separated by spaces")  # fmt: skip
    parser.add_argument("b", nargs="?", help="run folder B (or a folder of repeated runs); with --runs, "
                        "configuration B (optional: without it, A's repeatability)")  # fmt: skip
    parser.add_argument("--runs", type=int, metavar="N",
                        help="run each configuration N times with servelab-run (fresh processes; 3 or more "
                        "for a verdict)")  # fmt: skip
    parser.add_argument("--out", help="with --runs: folder for the runs (a/run_0, ...) and compare.csv "
                        "(default runs/compare/<time>)")  # fmt: skip
    parser.add_argument("--html", help="also write the table as an HTML page here")
    parser.add_argument(
        "--config", help="gate config with per-metric tolerances (default conf/gate/default.yaml)"
    )
    parser.add_argument("--explain", action="store_true",
                        help="decompose the change by step composition, engine phase and operator from the runs' "
                        "steps.csv and trace.json (profiling on); explain.json/html go to --out, else to B")  # fmt: skip
    return guard(_compare, parser, argv)
