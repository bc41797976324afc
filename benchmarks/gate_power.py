"""Power of the paired CI gate: how often it catches an injected slowdown, how often it cries wolf.

    PYTHONPATH=. .venv/bin/python benchmarks/gate_power.py --runs 10 --json runs/gate_power.jsonl

Each gate run is a full `servelab-gate --against HEAD` (conf/gate/paired.yaml: its own
workers, generations, pairs and time box) whose candidate's forward is slowed by one of
`--slowdowns` through the gate worker's test-only step hook (workloads/gate_worker.py
`--test-slowdown`, `SlowForward`); 0 is the no-change condition (the same commit on both sides). Conditions take turns (0, 5%, 10%,
20%, 0, ...) so that the machine's load drifts over all of them alike. Commit first: the
candidate is the working tree and the baseline is HEAD.

Prints per condition: runs, detections (the gate failed), the rate, the median estimated
change of CPU time per token and the longest gate run. `--budget-s` stops starting runs
after that many seconds (the table says how many ran).

On 2 cores the table takes about an hour one gate at a time; `--cpus 0` in one process and
`--cpus 1` in another (each gate's two workers pinned to one core, alternating on it as
always) halve that. `--summarize A.jsonl B.jsonl ...` then prints the one table over all
their rows, without running anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workloads.paired_gate import GateSettings, run_paired_gate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="gate runs per condition")
    parser.add_argument("--slowdowns", default="0,0.05,0.10,0.20", help="injected fractions, 0 = no change")
    parser.add_argument("--against", default="HEAD", help="the baseline ref (default HEAD: identical code)")
    parser.add_argument("--config", help="paired gate config (default conf/gate/paired.yaml)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no run after this")
    parser.add_argument("--json", help="append one JSON line per gate run here")
    parser.add_argument(
        "--cpus", help="pin both gate workers to these CPUs, e.g. 0 or 0,1 (default: the config's)"
    )
    parser.add_argument(
        "--summarize", nargs="+", metavar="JSONL", help="print the table of these files' rows; run nothing"
    )
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    try:
        slowdowns = [float(x) for x in args.slowdowns.split(",")]
    except ValueError:
        parser.error(f"--slowdowns: comma-separated fractions, got {args.slowdowns!r}")
    try:
        cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    except ValueError:
        parser.error(f"--cpus: comma-separated CPU numbers, got {args.cpus!r}")
    settings = GateSettings.load(args.config, cpus=cpus)
    results: dict[float, list[dict]] = {s: [] for s in slowdowns}
    t0 = time.perf_counter()
    for i in range(args.runs):
        for s in slowdowns:
            if time.perf_counter() - t0 > args.budget_s:
                break
            r = run_paired_gate(Path("."), args.against, settings, log=lambda _: None, candidate_slowdown=s)
            cpu = next((c for c in r.checks if c.metric == "cpu_ms_per_token"), None)
            row = {"slowdown": s, "run": i, "failed": r.regressed, "elapsed_s": r.elapsed_s, "pairs": r.pairs,
                   "flagged": [c.metric for c in r.checks if c.regressed],
                   "generations": len(set(r.generations)), "cpu_change": cpu.change if cpu else None,
                   "cpu_interval": cpu.interval if cpu else None, "cpu_p": cpu.p_value if cpu else None}  # fmt: skip
            results[s].append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print_table(results)
    return 0


def print_table(results: dict[float, list[dict]]) -> None:
    print("\n| injected slowdown | gate runs | failed | rate | median CPU/token change | its range over runs "
          "| pairs (generations), median | longest run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for s, rows in sorted(results.items()):
        if not rows:
            continue
        n, bad = len(rows), sum(r["failed"] for r in rows)
        changes = [r["cpu_change"] for r in rows if r["cpu_change"] is not None]
        label = "none (false alarms)" if s == 0 else f"{s:.0%}"
        median = f"{np.median(changes):+.1%}" if changes else "n/a"
        spread = f"{min(changes):+.1%} .. {max(changes):+.1%}" if changes else "n/a"
        counts = [(r["pairs"], r["generations"]) for r in rows if "pairs" in r and "generations" in r]
        pairs = f"{np.median([p for p, _ in counts]):.0f} ({np.median([g for _, g in counts]):.0f})" if counts else "n/a"
        print(f"| {label} | {n} | {bad} | {bad / n:.0%} | {median} | {spread} | {pairs} "
              f"| {max(r['elapsed_s'] for r in rows):.0f} s |")  # fmt: skip


def summarize(paths: list[str]) -> int:
    """The table over the rows of several --json files (e.g. two processes pinned to two cores)."""
    results: dict[float, list[dict]] = {}
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            print(f"gate_power: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                results.setdefault(float(row["slowdown"]), []).append(row)
            except (ValueError, KeyError, TypeError):
                print(f"gate_power: {path}:{number}: not a gate_power row", file=sys.stderr)
                return 2
    if not results:
        print("gate_power: no rows in " + ", ".join(paths), file=sys.stderr)
        return 2
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
