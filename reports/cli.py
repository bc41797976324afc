"""servelab-report, and the halves of servelab-compare and servelab-gate that read run folders.

The two commands themselves parse their arguments in workloads/compare_cli.py and
workloads/gate_cli.py, since `--runs N` and `--against REF` run workloads; what they do with run
folders already on disk is here (`compare_folders`, `compare_explain`, `stored_gate`). Nothing
here imports `workloads` (tests/test_import_graph.py).

Exit codes: 0 success (gate: no regression), 1 gate found a regression, 2 usage or
input error (missing folder or file), reported as one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from analysis.runfolder import JOURNAL, recover_partial
from reports.compare import compare, format_table, write_html
from reports.gate import check, context_notes, load_gate_config, load_summary, make_baseline, write_verdicts
from reports.run_data import RunFolderError
from reports.run_report import build_report
from reports.sweep import build_sweep_report

USAGE_ERRORS = (RunFolderError, FileNotFoundError, NotADirectoryError, ValueError, KeyError)


def guard(
    main: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> int:
    """`main(parser.parse_args(argv))`, a usage or input error reported as one line (exit 2)."""
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
    return guard(_report, parser, argv)


def explain_side(path: str) -> list[Path]:
    """A side's run folders: the folder itself, or its subfolders holding summary.json."""
    p = Path(path)
    return [p] if (p / "summary.json").exists() else sorted(d for d in p.iterdir() if (d / "summary.json").exists())


def compare_explain(args: argparse.Namespace) -> int:
    """servelab-compare --explain: the change decomposed from the runs' steps.csv and trace.json
    (reports/explain.py); explain.json and explain.html go to --out, else to B."""
    from analysis.explain import format_explain
    from reports.explain import explain_runs, write_outputs

    report = explain_runs(explain_side(args.a), explain_side(args.b))
    print(format_explain(report))
    for note in report["notes"]:
        print(f"explain: {note}")
    js, page = write_outputs(report, Path(args.out or args.b), f"servelab-compare --explain {args.a} → {args.b}")
    print(f"explain: {page} and {js.name}")
    return 0


def compare_folders(args: argparse.Namespace) -> int:
    """servelab-compare A B: the summary metrics of two run folders (or folders of repeats)."""
    df = compare(args.a, args.b, load_gate_config(args.config))
    print(format_table(df))
    if args.html:
        print(write_html(df, args.a, args.b, args.html))
    return 0


def stored_gate(args: argparse.Namespace) -> int:
    """servelab-gate --baseline / --make-baseline: run folders against a stored baseline; 0 pass,
    1 regression."""
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


if __name__ == "__main__":
    sys.exit(report_main())
