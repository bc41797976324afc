"""`servelab-explain BASE [CAND]`, and the paired gate's explanation of a FAIL.

Two commits (CAND defaults to the checkout itself) are checked out and run as the paired gate
runs them (workloads/paired_gate.py `gate_sides`: one worker process per tree, same threads,
affinity and environment, the gate's job from conf/gate/paired.yaml); each worker answers
`explain` with one profiled rep (workloads/explain_probe.py) and the pairs alternate which side
goes first. The decomposition is `analysis.explain.explain`; explain.json and explain.html
(reports/explain.py) go to the output folder and the top contributors to the console.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from analysis.explain import explain, format_explain
from reports.explain import write_outputs
from workloads.paired_gate import (
    GateSettings,
    Side,
    Worker,
    build_job,
    gate_kernels,
    gate_sides,
    pinned_probes,
)


def explain_workers(sides: dict[str, Side], job: dict[str, Any], settings: GateSettings, out_dir: Path,
                    repeats: int, args: dict[str, list[str]] | None = None,
                    log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Runs `repeats` profiled pairs (after one discarded) on a fresh worker per side
    ("baseline", "candidate"; `args`: extra worker arguments per side); returns the report."""
    workers = {name: Worker(f"explain-{name}", *sides[name], settings.cpus, out_dir, 0, (args or {}).get(name))
               for name in ("baseline", "candidate")}  # fmt: skip
    reps: dict[str, list[dict[str, Any]]] = {"baseline": [], "candidate": []}
    try:
        line = json.dumps(job)
        for w in workers.values():
            w.send(line)
        for w in workers.values():
            w.receive(settings.rep_timeout_s * (settings.warmup_runs + 1) + 600)
        log(f"explain: workers ready; {repeats} profiled pair(s)")
        for i in range(repeats + 1):
            order = ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
            for name in order:
                workers[name].send("explain")
                rep = workers[name].receive(settings.rep_timeout_s * 4)  # profiling costs a few times a rep
                if i:
                    reps[name].append(rep)
    finally:
        for w in workers.values():
            w.close()
    return explain(reps["baseline"], reps["candidate"])


def explain_refs(repo: Path, base: str, cand: str | None, settings: GateSettings, out_dir: Path, repeats: int,
                 candidate_slowdown: float = 0.0, log: Callable[[str], None] = print,
                 candidate_env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """`base` against `cand` (a ref; None: the checkout), written to `out_dir`; the report."""
    repo = repo.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    commit, _tree, sides, notes = gate_sides(repo, base, settings, candidate_env)
    if cand is not None:
        cand_commit, _, cand_sides, cand_notes = gate_sides(repo, cand, settings)
        sides["candidate"] = cand_sides["baseline"]
        notes += [n.replace("baseline", "candidate") for n in cand_notes]
    pins, pin_note = pinned_probes(gate_kernels(settings))
    notes.append(pin_note)
    for n in notes:
        log(f"explain: {n}")
    args = None
    if candidate_slowdown:  # TEST ONLY, as the gate's --candidate-slowdown
        args = {"baseline": ["--test-slowdown", "0"], "candidate": ["--test-slowdown", f"{candidate_slowdown}"]}
    report = explain_workers(sides, build_job(settings, pins), settings, out_dir, repeats, args, log)
    report["baseline_commit"] = commit
    report["candidate"] = cand or "the checkout"
    write_outputs(report, out_dir, f"servelab-explain {commit[:12]} → {cand or 'checkout'}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="servelab-explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the baseline commit (any git ref)")
    parser.add_argument("cand", nargs="?", help="the candidate commit (default: the checkout, uncommitted work too)")
    parser.add_argument("--repo", default=".", help="the checkout (default: the working directory)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="profiled pairs; the contributors' intervals are simultaneous, so 3 pairs name only "
                        "large changes (default: %(default)s)")
    parser.add_argument("--config", help="paired gate config (default: conf/gate/paired.yaml)")
    parser.add_argument("--out", help="folder for explain.json / explain.html (default: a temporary one)")
    parser.add_argument("--candidate-slowdown", type=float, default=0.0, help="TEST ONLY: as servelab-gate's")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats: needs 2 or more pairs for an interval")
    out = Path(args.out or tempfile.mkdtemp(prefix="servelab-explain-"))
    try:
        report = explain_refs(Path(args.repo), args.base, args.cand, GateSettings.load(args.config), out,
                              args.repeats, args.candidate_slowdown)  # fmt: skip
    except (RuntimeError, ValueError) as exc:
        print(f"servelab-explain: {exc}", file=sys.stderr)
        return 2
    print(format_explain(report))
    print(f"explain: {out / 'explain.html'} and explain.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
