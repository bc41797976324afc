"""servelab-plan `plan.verify=K`: run the K best simulated picks for real and compare.

The simulator screens every configuration and rate cheaply; a deployer should not trust the
ranking without a check. `verify(cfg, rows, K)` takes the K best rows (those meeting the SLOs
first, by rate, goodput and throughput; then the rest by output throughput), runs each on
`target.kind` (inprocess, server, openai, ...: any servelab-run target) with the pick's token
budget and max_num_seqs and the traffic the planner simulated at the pick's rate (synthetic: the
very arrivals the simulator drew, written to `pickN_arrivals.jsonl` and replayed as a trace of
token-id prompts, so both sides serve the same requests at the same times; trace: the same slice
at the pick's time scale), one run folder each under `<plan.out>/verify/`, and reports for each pick the
simulated and the measured mean / p99 TTFT and TPOT and output throughput with the relative
error (simulated - measured) / measured, and the machine's 1-minute load average before and after
each run with its core count: a measured latency on a shared host is the host's load as much
as the engine's (docs/capacity.md has a run where it was all of it).
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conf.schema import PlanConfig

COMPARED = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "output_throughput")


def picks(rows: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The K best rows: SLO-meeting ones by (rate, goodput, throughput), then the others by throughput."""
    ok = sorted(
        (r for r in rows if r["meets_slo"]),
        key=lambda r: (r["rate"], r["request_goodput"] or 0.0, r["output_throughput"] or 0.0),
        reverse=True,
    )
    rest = sorted(
        (r for r in rows if not r["meets_slo"]), key=lambda r: r["output_throughput"] or 0.0, reverse=True
    )
    return (ok + rest)[:k]  # fmt: skip


def run_config(cfg: PlanConfig, row: dict[str, Any], arrivals: Path | None = None) -> PlanConfig:
    """The plan's config set to one pick: its budget, sequence limit and load. `arrivals`: a
    synthetic plan's simulated requests (a JSONL trace), replayed as a trace."""
    run = copy.deepcopy(cfg)
    run.scheduler.max_num_batched_tokens = int(row["max_num_batched_tokens"])
    run.scheduler.max_num_seqs = int(row["max_num_seqs"])
    w = run.workload
    if w.kind == "trace":
        w.trace.time_scale = float(row["time_scale"])
        w.trace.lengths = "clamp"  # as the planner fits them
    elif arrivals is not None:
        w.kind = "trace"
        w.trace.path, w.trace.format, w.trace.time_scale = str(arrivals), "jsonl", 1.0
        w.trace.start_s = w.trace.end_s = w.trace.max_requests = None
        w.trace.lengths, w.trace.max_output_tokens = "clamp", None
    else:
        w.arrival.process, w.arrival.rate = "poisson", float(row["rate"])
    w.concurrency = None
    return run


def relative_error(simulated: float | None, measured: float | None) -> float | None:
    """(simulated - measured) / measured; None when either is missing or measured is 0."""
    if simulated is None or measured is None or measured == 0:
        return None
    return (simulated - measured) / measured


def verify(
    cfg: PlanConfig, rows: Sequence[dict[str, Any]], k: int, arrivals: Callable[[float], Sequence[Any]] | None = None
) -> list[dict[str, Any]]:
    """Run the K best picks on `cfg.target`; one comparison dict per pick (see the module doc).
    `arrivals(rate)`: a synthetic plan's simulated requests at that rate (None: a fresh Poisson draw)."""
    from workloads.experiment import run_experiment
    from workloads.trace_tools import write_jsonl

    root = (
        Path(cfg.plan.out) / "verify" if cfg.plan.out else Path(tempfile.mkdtemp(prefix="servelab-verify-"))
    )
    out = []
    for i, row in enumerate(picks(rows, k)):
        run_dir = root / f"pick{i}"
        load_before = _load_average()
        trace = None
        if arrivals is not None:
            trace = root / f"pick{i}_arrivals.jsonl"
            root.mkdir(parents=True, exist_ok=True)
            write_jsonl(list(arrivals(float(row["rate"]))), trace)
        outcome = run_experiment(run_config(cfg, row, trace), run_dir)
        load = {"before": load_before, "after": _load_average(), "cores": os.cpu_count()}
        measured = {m: outcome.summary.get(m) for m in COMPARED}
        simulated = {m: row.get(m) for m in COMPARED}
        out.append({
            "config": f"budget {row['max_num_batched_tokens']}, seqs {row['max_num_seqs']} @ {row['rate']:.4g}/s",
            "max_num_batched_tokens": row["max_num_batched_tokens"], "max_num_seqs": row["max_num_seqs"],
            "rate": row["rate"], "target": cfg.target.kind, "run_dir": str(run_dir), "error": outcome.error,
            "simulated": simulated, "measured": measured, "load_average": load,
            "relative_error": {m: relative_error(simulated[m], measured[m]) for m in COMPARED},
        })  # fmt: skip
    return out


def _load_average() -> float | None:
    """The host's 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _load_note(load: dict[str, Any] | None) -> str:
    if not load or load.get("before") is None:
        return ""
    return f" (load average {load['before']:g} -> {load['after']:g} on {load['cores']} cores)"


def render_verify(results: Sequence[dict[str, Any]]) -> None:
    """One line per pick and figure: simulated, measured, error; the host's load per pick."""
    for r in results:
        head = f"verify {r['config']} on {r['target']}" + _load_note(r.get("load_average"))
        print(head + (f": FAILED {r['error']}" if r["error"] else ""))
        for m in COMPARED:
            sim, meas, err = r["simulated"][m], r["measured"][m], r["relative_error"][m]
            fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
            print(f"  {m:<18} simulated {fmt(sim):>9}  measured {fmt(meas):>9}  error "
                  + ("-" if err is None else f"{err:+.1%}"))  # fmt: skip


def verify_html(results: Sequence[dict[str, Any]]) -> str:
    """plan.html's section: a row per pick and figure."""
    if not results:
        return ""
    import html

    import pandas as pd

    table = pd.DataFrame([
        {"pick": r["config"] + _load_note(r.get("load_average")), "target": r["target"], "figure": m,
         "simulated": r["simulated"][m], "measured": r["measured"][m], "error": r["relative_error"][m]}
        for r in results for m in COMPARED
    ])  # fmt: skip
    body = table.to_html(index=False, float_format=lambda v: f"{v:.4g}")
    return f"<h2>Verified picks</h2><p>{html.escape('error = (simulated - measured) / measured')}</p>{body}"
