"""Console entry points: `servelab-history` (record, changes, report, summary, runs) and
`servelab-bisect`.

Exit codes: 0 success; servelab-history changes --fail-on-regression: 1 when a regression
change point lies after --since; servelab-bisect: see history/bisect.py; 2 usage or input
error, one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.exc import SQLAlchemyError

from history.schema import SchemaTooNew
from history.store import DEFAULT_URL, Store

if TYPE_CHECKING:
    from history.bisect import Bisector
    from history.ingest import Record

USAGE_ERRORS = (FileNotFoundError, NotADirectoryError, ValueError, KeyError, subprocess.CalledProcessError,
                SQLAlchemyError, SchemaTooNew)  # fmt: skip


def _first_line(exc: BaseException) -> str:
    """An error as one line (SQLAlchemy's add the statement and a link on lines of their own)."""
    if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
        return str(exc.stderr).strip().splitlines()[-1]
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _guard(main: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
           argv: Sequence[str] | None) -> int:  # fmt: skip
    args = parser.parse_args(argv)
    try:
        return main(args)
    except USAGE_ERRORS as e:
        print(f"{parser.prog}: error: {_first_line(e)}", file=sys.stderr)
        return 2


def _record(args: argparse.Namespace) -> int:
    from history.ingest import load_record

    with Store(args.history) as store:
        for path in map(Path, args.paths):
            rec = load_record(path, Path(args.repo), args.commit, Path(args.gate_config) if args.gate_config else None)
            run_id = store.add(rec)
            what = f"{rec.kind} at {rec.commit.sha[:12]}{' (dirty)' if rec.commit.dirty else ''}"
            if run_id is None:
                print(f"history: {path}: already recorded ({what})")
            else:
                print(f"history: recorded {path} as run {run_id}: {what}, {len(rec.measurements)} values, "
                      f"machine {rec.machine.fingerprint} ({rec.machine.cpu_model})")  # fmt: skip
            if rec.kind == "run" and not args.no_link:
                _link(store, args.history, rec)
    return 0


def _link(store: Store, url: str, rec: Record) -> None:
    """The run folder's history page and its report's link (history/run_link.py); a failure is one
    line on stderr: the record is stored whatever the page does."""
    from history.run_link import link_run_history

    try:
        link_run_history(store, url, rec, Path(rec.source_path))
    except Exception as exc:
        print(f"history: {rec.source_path}: recorded, but its history page was not written: "
              f"{type(exc).__name__}: {_first_line(exc)}", file=sys.stderr)  # fmt: skip


def record_after_run(url: str, run_dirs: list[str], repo: Path = Path(".")) -> None:
    """`servelab-run run.history=URL` (workloads/cli.py): each finished run folder into the store, at
    the checkout's commit. A failure to record is one line on stderr, never the run's exit code."""
    try:
        from history.ingest import load_record

        with Store(url) as store:
            for run_dir in run_dirs:
                rec = load_record(Path(run_dir), repo)
                stored = store.add(rec)
                print(f"history: {run_dir}: {'recorded' if stored is not None else 'already recorded'} in {url}")
                _link(store, url, rec)
    except Exception as exc:  # the run's results stand whatever the store says
        print(f"servelab-run: run.history: not recorded: {type(exc).__name__}: {_first_line(exc)}", file=sys.stderr)


def record_after_gate(url: str, gate_json: Path, repo: Path = Path("."), gate_config: Path | None = None) -> None:
    """`servelab-gate --against REF --history URL` (workloads/gate_cli.py): the gate's gate.json into
    the store, at the checkout's commit (its candidate) with the baseline commit it measured in the
    same run. A failure to record is one line on stderr, never the gate's verdict or exit code."""
    try:
        from history.ingest import load_record

        with Store(url) as store:
            rec = load_record(gate_json, repo, "HEAD", gate_config)
            stored = store.add(rec)
            dirty = " (dirty checkout: left out of change detection)" if rec.commit.dirty else ""
            print(f"history: gate at {rec.commit.sha[:12]} {'recorded' if stored is not None else 'already recorded'} "
                  f"in {url}{dirty}")  # fmt: skip
    except Exception as exc:  # the verdict stands whatever the store says
        print(f"servelab-gate: --history: not recorded: {type(exc).__name__}: {_first_line(exc)}", file=sys.stderr)


def _settings(args: argparse.Namespace):  # -> history.changes.Settings
    from history.changes import Settings

    return replace(Settings(), alpha=args.alpha, min_change=args.min_change, permutations=args.permutations)


def _scan(args: argparse.Namespace):  # -> history.changes.Scan
    from history.changes import scan
    from history.machine import commit_info

    since = commit_info(Path(args.repo), args.since, check_dirty=False).time if args.since else None
    with Store(args.history) as store:
        rows = store.measurements(args.metric, args.machine, since, args.include_dirty)
    if args.kind:
        rows = rows[rows["kind"] == args.kind]
    return scan(rows, _settings(args))


def _changes(args: argparse.Namespace) -> int:
    result = _scan(args)
    changes = result.all_changes()
    print(f"history: {len(result.series)} series, {len(changes)} change point(s) "
          f"(alpha {args.alpha}, {args.permutations} permutations)")  # fmt: skip
    for c in changes:
        print(c.line())
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "metric": c.series.metric, "machine": c.series.machine, "config": c.series.config,
            "config_name": c.series.config_name, "last_before": c.last_before, "first_after": c.first_after,
            "change": c.change, "interval": list(c.interval), "p_value": c.p_value, "kind": c.kind,
            "before": c.before, "after": c.after, "n_before": c.n_before, "n_after": c.n_after,
        } for c in changes], indent=2))  # fmt: skip
    if args.fail_on_regression and any(c.kind == "regression" for c in changes):
        return 1
    return 0


def _report(args: argparse.Namespace) -> int:
    from history.report import build_history_report

    print(build_history_report(_scan(args), Path(args.out)))
    return 0


def _summary(args: argparse.Namespace) -> int:
    from history.summary import summary_markdown

    gate, note = None, ""
    if args.gate_json and Path(args.gate_json).is_file():
        gate = json.loads(Path(args.gate_json).read_text())
    elif args.gate_json:  # the gate stopped before its verdict: say so, and still show the history
        note = f"No gate.json at `{args.gate_json}`: the gate did not reach a verdict (see its log)."
    changes = _scan(args).all_changes() if args.with_history else None
    text = summary_markdown(gate, changes, args.top, note)
    if args.out:
        with open(args.out, "a") as f:  # $GITHUB_STEP_SUMMARY is appended to
            f.write(text)
    else:
        print(text, end="")
    return 0


def _runs(args: argparse.Namespace) -> int:
    with Store(args.history) as store:
        df = store.runs()
    cols = ["id", "kind", "commit_sha", "dirty", "branch", "verdict", "config_name", "machine_fp", "torch_version"]
    print(df[cols].assign(commit_sha=df["commit_sha"].str[:12]).to_string(index=False) if len(df) else "no runs")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--history", default=DEFAULT_URL,
                   help="the store: an SQLite file or an SQLAlchemy URL (default: %(default)s)")  # fmt: skip
    p.add_argument("--repo", default=".", help="the git checkout (default: the working directory)")


def _scan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metric", help="one metric (default: every one)")
    p.add_argument("--machine", help="one machine fingerprint (a prefix will do)")
    p.add_argument("--kind", choices=["run", "gate"], help="only runs or only gates")
    p.add_argument("--since", metavar="REF", help="only commits from REF's commit time on")
    p.add_argument("--include-dirty", action="store_true", help="also records of checkouts with uncommitted changes")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of a change point (default: 0.01)")
    p.add_argument("--permutations", type=int, default=499, help="permutations per test (default: 499)")
    p.add_argument("--min-change", type=float, default=0.0,
                   help="leave out change points smaller than this relative change (default: 0)")  # fmt: skip


def history_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelab-history", description="Record runs and gates; find change points; "
                                     "report the history (docs/history.md).")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="store a run folder or a paired gate's gate.json")
    rec.add_argument("paths", nargs="+", help="run folders and/or gate.json files")
    rec.add_argument("--commit", default="HEAD", help="the commit they measured (default: the checkout's HEAD)")
    rec.add_argument("--gate-config", help="the gate config they ran under (default: REPO/conf/gate/paired.yaml)")
    rec.add_argument("--no-link", action="store_true", help="leave run folders as they are (default: write each "
                     "one's history.html and link its report.html to it)")  # fmt: skip
    _common(rec)
    rec.set_defaults(func=_record)
    ch = sub.add_parser("changes", help="change points per metric and machine")
    _common(ch)
    _scan_options(ch)
    ch.add_argument("--json", help="also write the change points here")
    ch.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a regression is found")
    ch.set_defaults(func=_changes)
    rep = sub.add_parser("report", help="the HTML history report")
    _common(rep)
    _scan_options(rep)
    rep.add_argument("--out", default="runs/history/report.html", help="the page (default: %(default)s)")
    rep.set_defaults(func=_report)
    sm = sub.add_parser("summary", help="Markdown for $GITHUB_STEP_SUMMARY / a PR comment")
    sm.add_argument("gate_json", nargs="?", help="a paired gate's gate.json")
    sm.add_argument("--with-history", action="store_true", help="add the store's top change points")
    sm.add_argument("--top", type=int, default=5, help="change points to list (default: %(default)s)")
    sm.add_argument("--out", help="append to this file (e.g. $GITHUB_STEP_SUMMARY) instead of printing")
    _common(sm)
    _scan_options(sm)
    sm.set_defaults(func=_summary)
    runs = sub.add_parser("runs", help="list the stored runs")
    _common(runs)
    runs.set_defaults(func=_runs)
    return parser


def history_main(argv: Sequence[str] | None = None) -> int:
    parser = history_parser()
    return _guard(lambda a: a.func(a), parser, argv)


def _bisect(args: argparse.Namespace) -> int:
    from history.bisect import Bisector, BisectSettings, sigterm_stops

    if args.pairs < 2 or args.time_box_s <= 0:
        raise ValueError(f"--pairs {args.pairs} / --time-box-s {args.time_box_s:g}: give at least 2 pairs and a "
                         "positive time box")  # fmt: skip
    if args.odds != 0 and args.odds <= 1:
        raise ValueError(f"--odds {args.odds:g}: give a ratio above 1 (or 0 for the interval rule alone)")
    settings = BisectSettings(args.metric, args.gate_cmd, args.explain_cmd or None, args.retries, args.threshold,
                              args.in_place, args.odds, args.pairs, args.time_box_s)  # fmt: skip
    out = Path(args.out)
    on_gate = None
    if args.history:
        store = Store(args.history)

        def on_gate(gate_json: Path, tree: Path) -> None:
            from history.ingest import load_record

            store.add(load_record(gate_json, tree, "HEAD", None))

    b = Bisector(Path(args.repo), args.good, args.bad, settings, out, log=lambda s: print(s, flush=True),
                 on_gate=on_gate)  # fmt: skip
    with sigterm_stops():
        return _bisect_run(b, args, out)


def _bisect_run(b: Bisector, args: argparse.Namespace, out: Path) -> int:
    result = b.run()
    code = 1
    if result.first_bad:
        subject = subprocess.run(["git", "-C", args.repo, "show", "-s", "--format=%s", result.first_bad],
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
        secs = [s.seconds for s in result.steps]
        print(f"bisect: first bad commit {result.first_bad} ({subject}); {result.gate_runs} gate runs, "
              f"{sum(secs):.0f} s ({sum(secs) / len(secs):.1f} s per run)")  # fmt: skip
        explained = b.explain()
        if explained:
            print(explained)
        code = 0
    elif result.candidates:
        print(f"bisect: undecided: every commit left was inconclusive; the first bad commit is one of "
              f"{', '.join(c[:10] for c in result.candidates)}")  # fmt: skip
        code = 3
    (out / "bisect.json").write_text(json.dumps(result.to_json(), indent=2))
    print(f"bisect: {out / 'bisect.json'}")
    return code


def bisect_main(argv: Sequence[str] | None = None) -> int:
    from history.bisect import (
        DEFAULT_EXPLAIN_CMD,
        DEFAULT_GATE_CMD,
        DEFAULT_ODDS,
        DEFAULT_PAIRS,
        DEFAULT_TIME_BOX_S,
    )

    parser = argparse.ArgumentParser(prog="servelab-bisect", description="Find the first commit that made a metric "
                                     "worse: git bisect with the paired gate (history/bisect.py).")  # fmt: skip
    parser.add_argument("good", help="a commit without the regression")
    parser.add_argument("bad", help="a later commit with it")
    parser.add_argument("--metric", default="cpu_ms_per_token", help="the gate metric (default: %(default)s)")
    parser.add_argument("--repo", default=".", help="the checkout (default: the working directory)")
    parser.add_argument("--out", default="runs/bisect", help="gate runs and bisect.json (default: %(default)s)")
    parser.add_argument("--retries", type=int, default=1, help="gate runs more for an inconclusive commit before "
                        "skipping it, and for a step GOOD -> BAD measured wider than half its size "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS, help="pairs each gate run measures: {pairs} of "
                        "the gate command (default: %(default)s; the gate alone: 16)")  # fmt: skip
    parser.add_argument("--time-box-s", type=float, default=DEFAULT_TIME_BOX_S, help="each gate run's time box: "
                        "{time_box_s} of the gate command (default: %(default)g)")  # fmt: skip
    parser.add_argument("--threshold", type=float, help="a worsening above this is bad (default: half the step)")
    parser.add_argument("--odds", type=float, default=DEFAULT_ODDS,
                        help="a commit whose interval straddles the threshold is bad where the step is this many times "
                             "as likely as no change, good where no change is; 0: the interval rule alone "
                             "(default: %(default)g)")  # fmt: skip
    parser.add_argument("--gate-cmd", default=DEFAULT_GATE_CMD, help="the gate command template (default: %(default)s)")
    parser.add_argument("--explain-cmd", default=DEFAULT_EXPLAIN_CMD,
                        help="run on the first bad commit; '' for none (default: %(default)s)")  # fmt: skip
    parser.add_argument("--in-place", action="store_true", help="bisect the checkout itself, not a worktree")
    parser.add_argument("--history", help="also record every gate run in this store")
    return _guard(_bisect, parser, argv)


if __name__ == "__main__":
    sys.exit(history_main())
