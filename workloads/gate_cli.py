"""`servelab-gate`: its command line, and `--against REF`: the paired gate's options, table and fallback.

The stored-baseline modes (`--baseline`, `--make-baseline`) read run folders only
(reports/cli.py `stored_gate`); the command sits here because `--against` runs workloads.

Without git history to compare with (no .git, a shallow clone lacking the commit, a first
commit) it says so in one line and falls back to the stored-baseline gate: the ci_gate
experiment once, compared with `--fallback-baseline` under conf/gate/ci.yaml.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import conf
from reports.cli import guard, stored_gate
from reports.run_data import RunFolderError
from workloads.gate_stats import format_table
from workloads.gate_trees import NoHistory
from workloads.paired_gate import GateSettings, run_paired_gate

STORED_CONFIG = Path(conf.__file__).parent / "gate" / "ci.yaml"


def add_paired_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("paired gate (--against)")
    group.add_argument("--repo", default=".", help="the checkout to gate (default: the working directory)")
    group.add_argument("--pairs", type=int, help="most pairs to measure (default: the config's max_pairs)")
    group.add_argument("--time-box-s", type=float, help="stop starting pairs after this (default: the config's)")
    group.add_argument("--out", help="folder for gate.json and the workers' logs (default: a temporary one)")
    group.add_argument(
        "--fallback-baseline", default="benchmarks/baselines/ci_gate.json",
        help="stored baseline used when there is no git history (default: %(default)s)",
    )
    group.add_argument("--fallback-run", default="runs/ci_gate/latest", help="run folder of the fallback run")
    group.add_argument(
        "--candidate-env", action="append", default=[], metavar="KEY=VALUE",
        help="an environment variable for the candidate's worker only",
    )
    group.add_argument(
        "--candidate-slowdown", type=float, default=0.0, metavar="FRACTION",
        help="TEST ONLY: slow the candidate's forward by FRACTION (e.g. 0.1) through a step hook, to measure "
        "the gate's power (benchmarks/gate_power.py)",
    )
    group.add_argument(
        "--history", metavar="URL",
        help="also record gate.json in this results store (servelab-history: an SQLite file path or an "
        "SQLAlchemy URL); a failure to record is one line on stderr, never the verdict (default: no record)",
    )
    group.add_argument(
        "--explain-repeats", type=int, default=5, metavar="N",
        help="on FAIL, N profiled pairs decompose the change (servelab-explain; explain.html and explain.json "
        "beside gate.json); 0: none (default: %(default)s)",
    )


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--candidate-env: expected KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def run_ci_gate_experiment(run: Path) -> int:
    """`servelab-run experiment=ci_gate` into `run` (the stored-baseline gate's run); its exit code."""
    return subprocess.run([sys.executable, "-m", "workloads.cli", "experiment=ci_gate", f"hydra.run.dir={run}"]).returncode


def _fallback(args: argparse.Namespace, stored_gate: Callable[[argparse.Namespace], int]) -> int:
    run = Path(args.fallback_run)
    code = run_ci_gate_experiment(run)
    if code != 0:
        raise RunFolderError(f"the fallback ci_gate run failed (exit {code})")
    stored = argparse.Namespace(config=str(STORED_CONFIG), baseline=args.fallback_baseline, make_baseline=None,
                                runs=[str(run)], verbose=args.verbose)  # fmt: skip
    return stored_gate(stored)


def paired_gate(args: argparse.Namespace, stored_gate: Callable[[argparse.Namespace], int]) -> int:
    """Runs the paired gate and prints its table; 0 pass, 1 regression (exit codes of servelab-gate)."""
    if args.runs:
        raise ValueError("--against measures its own runs: give no run folders")
    settings = GateSettings.load(args.config, max_pairs=args.pairs, time_box_s=args.time_box_s)
    try:
        result = run_paired_gate(Path(args.repo), args.against, settings, _env_pairs(args.candidate_env),
                                 log=lambda s: print(f"gate: {s}", flush=True),
                                 out_dir=Path(args.out) if args.out else None,
                                 candidate_slowdown=getattr(args, "candidate_slowdown", 0.0))  # fmt: skip
    except NoHistory as exc:
        print(f"servelab-gate: {exc}; falling back to the stored baseline {args.fallback_baseline}", flush=True)
        return _fallback(args, stored_gate)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None  # a worker failed: one line, exit 2
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit {exc.returncode}"]
        raise ValueError(f"{' '.join(map(str, exc.cmd))}: {last[0]}") from None
    print(format_table(result.checks))
    print(f"gate: {len(set(result.generations))} generations of workers (the interval resamples them); "
          "p: exact signed-rank test of the per-generation median ratios")  # fmt: skip
    bad = [c.metric for c in result.checks if c.regressed]
    print(f"gate: {'FAIL' if bad else 'PASS'} ({len(bad)} regression(s) in {len(result.checks)} metrics"
          f"{': ' + ', '.join(bad) if bad else ''}; {result.pairs} pairs against {result.baseline_commit[:12]}, "
          f"{result.elapsed_s:.0f} s)")  # fmt: skip
    if args.verbose:
        print(json.dumps(result.notes))
    if getattr(args, "history", None):
        from history.cli import record_after_gate

        record_after_gate(args.history, Path(result.out_dir) / "gate.json", Path(args.repo),
                          Path(args.config) if args.config else None)  # fmt: skip
    if bad and getattr(args, "explain_repeats", 0) >= 2:
        explain_failure(args, settings, result.baseline_commit, Path(result.out_dir))
    return 1 if bad else 0


def explain_failure(args: argparse.Namespace, settings: GateSettings, commit: str, out: Path) -> None:
    """The FAIL's top contributors after the verdict (workloads/explain_cli.py); a failure to
    explain is one line, never a change of the verdict."""
    from analysis.explain import format_explain
    from workloads.explain_cli import explain_refs

    try:
        report = explain_refs(Path(args.repo), commit, None, settings, out, args.explain_repeats,
                              getattr(args, "candidate_slowdown", 0.0), log=lambda s: None,
                              candidate_env=_env_pairs(args.candidate_env))  # fmt: skip
    except Exception as exc:  # whatever breaks the explanation, the verdict stands
        print(f"gate: explain failed: {type(exc).__name__}: {exc}")
        return
    print(format_explain(report))
    print(f"gate: explained in {out / 'explain.html'} and explain.json")


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
    add_paired_arguments(parser)
    args = parser.parse_args(argv)
    if args.against is None and not args.runs:
        parser.error("the run folders are required with --baseline / --make-baseline")
    return guard(_paired_gate if args.against is not None else stored_gate, parser, argv)


def _paired_gate(args: argparse.Namespace) -> int:
    return paired_gate(args, stored_gate=stored_gate)
