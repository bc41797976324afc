"""Console entry points: servelab-report, servelab-compare, servelab-gate.

Exit codes: 0 success (gate: no regression), 1 gate found a regression, 2 usage or
input error (missing folder or file), reported as one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from reports.compare import compare, format_table, write_html
from reports.gate import check, context_notes, load_gate_config, load_summary, make_baseline, write_verdicts
from reports.run_data import RunFolderError
from reports.run_report import build_report
from reports.sweep import build_sweep_report
from workloads.runfolder import JOURNAL, recover_partial

USAGE_ERRORS = (RunFolderError, FileNotFoundError, NotADirectoryError, ValueError, KeyError)


def _guard(
    main: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> int:
    args = parser.parse_args(argv)
    try:
        return main(args)
    except USAGE_ERRORS as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def _slo_of_run(run_dir: Path) -> dict[str, float | None]:
    import yaml

    cfg_path = run_dir / "config.yaml"
    slo = ((yaml.safe_load(cfg_path.read_text()) or {}).get("slo") if cfg_path.exists() else None) or {}
    return {k: slo.get(k) for k in ("ttft_ms", "tpot_ms", "e2el_ms")}


def _report(args: argparse.Namespace) -> int:
    for p in map(Path, args.runs):
        if not p.is_dir():
            raise RunFolderError(f"not a run folder: {p}")
        if (p / JOURNAL).exists() and not (p / "summary.json").exists():
            # A killed run: its finished requests are in the journal; keep them, marked partial.
            recover_partial(p, _slo_of_run(p), "the harness stopped before writing its results")
            print(f"{p}: recovered the finished requests of an interrupted run (summary marked partial)")
        out = build_sweep_report(p) if (p / "sweep.csv").exists() else build_report(p)
        print(out)
    return 0


def report_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="servelab-report", description="Rebuild report.html of run or sweep folders."
    )
    parser.add_argument("runs", nargs="+", help="run folders (or sweep folders holding sweep.csv)")
    return _guard(_report, parser, argv)


def _explain_side(path: str) -> list[Path]:
    """A side's run folders: the folder itself, or its subfolders holding summary.json."""
    p = Path(path)
    return [p] if (p / "summary.json").exists() else sorted(d for d in p.iterdir() if (d / "summary.json").exists())


def _compare_explain(args: argparse.Namespace) -> int:
    """--explain: the change decomposed from the runs' steps.csv and trace.json (reports/explain.py)."""
    from reports.explain import explain_runs
    from workloads.explain import format_explain
    from workloads.explain_cli import write_outputs

    report = explain_runs(_explain_side(args.a), _explain_side(args.b))
    print(format_explain(report))
    for note in report["notes"]:
        print(f"explain: {note}")
    js, page = write_outputs(report, Path(args.out or args.b), f"servelab-compare --explain {args.a} → {args.b}")
    print(f"explain: {page} and {js.name}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    if args.runs is not None:
        return _compare_runs(args)
    if getattr(args, "explain", False):
        if args.b is None:
            raise ValueError("--explain: give two run folders")
        return _compare_explain(args)
    if args.b is None:
        raise ValueError("give two run folders (or --runs N with one or two configurations)")
    df = compare(args.a, args.b, load_gate_config(args.config))
    print(format_table(df))
    if args.html:
        print(write_html(df, args.a, args.b, args.html))
    return 0


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
    return _guard(_compare, parser, argv)


def _gate(args: argparse.Namespace) -> int:
    config = load_gate_config(args.config)
    for r in args.runs:
        if not Path(r).is_dir():
            raise RunFolderError(f"not a run folder: {r}")
    if args.make_baseline:
        make_baseline(args.runs, args.make_baseline, config)
        print(f"baseline written: {args.make_baseline} ({len(args.runs)} run(s))")
        return 0
    baseline_path = Path(args.baseline)
    if not baseline_path.is_file():
        raise FileNotFoundError(f"baseline file not found: {baseline_path}")
    baseline, summaries = json.loads(baseline_path.read_text()), [load_summary(r) for r in args.runs]
    checks, notes = check(baseline, summaries, config), context_notes(baseline, summaries)
    write_verdicts(args.runs, checks, baseline_path, notes)
    for note in notes:
        print(note)
    for c in checks:
        if c.regressed or args.verbose:
            print(c.line())
    bad = sum(c.regressed for c in checks)
    print(f"gate: {'FAIL' if bad else 'PASS'} ({bad} regression(s) in {len(checks)} metrics)")
    return 1 if bad else 0


def _paired_gate(args: argparse.Namespace) -> int:
    from workloads.gate_cli import paired_gate

    return paired_gate(args, stored_gate=_gate)


def gate_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="servelab-gate",
        description="Fail when runs regress against a baseline: a stored one (--baseline) or a git "
        "commit measured in the same run, pair by pair (--against).",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--baseline", help="baseline JSON to compare the runs with")
    mode.add_argument("--make-baseline", metavar="FILE", help="write a baseline JSON from the runs")
    mode.add_argument(
        "--against", metavar="REF",
        help="paired gate against git REF ('auto': the merge-base with main, else HEAD~1); see docs/benchmarks.md",
    )
    parser.add_argument("runs", nargs="*", help="run folders (repeats are compared by median)")
    parser.add_argument("--config", help="gate config (default conf/gate/default.yaml; --against: conf/gate/paired.yaml)")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print every check, not only regressions"
    )
    from workloads.gate_cli import add_paired_arguments

    add_paired_arguments(parser)
    args = parser.parse_args(argv)
    if args.against is None and not args.runs:
        parser.error("the run folders are required with --baseline / --make-baseline")
    return _guard(_paired_gate if args.against is not None else _gate, parser, argv)


if __name__ == "__main__":
    sys.exit(report_main())
