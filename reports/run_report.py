"""report.html of one run folder: the ordered list of sections and the page.

Section ids are stable (tests and links rely on them): see `SECTION_IDS`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reports import sections_engine as eng
from reports import sections_kv as kv
from reports import sections_load as load
from reports import sections_requests as rq
from reports import sections_slo as slo
from reports.page import Link, Section, guarded, render_page
from reports.run_data import RunData, load_run

SECTIONS = (
    (rq.workload_config, "workload-config", "Workload and configuration"),
    (rq.summary_table, "summary", "Summary"),
    (rq.distributions, "latency-distributions", "Latency distributions"),
    (rq.over_time, "over-time", "Latency and throughput over time"),
    (load.load_phases, "steady-state", "Steady state and time slices"),
    (eng.kv_and_batch, "kv-batch", "KV-cache utilization and batch composition"),
    (eng.preemption_prefix, "preemption-prefix", "Preemptions and prefix-cache hit rate"),
    (kv.kv_connector, "kv-connector", "External KV (connector)"),
    (eng.kernels, "kernels", "Kernel-time breakdown"),
    (eng.telemetry, "telemetry", "GPU and host telemetry"),
    (rq.client_lateness, "client-lateness", "Client lateness check"),
    (rq.goodput, "goodput", "Goodput vs SLOs"),
    (slo.slo_misses, "slo-misses", "SLO misses by cause"),
    (rq.server_split, "server-split", "Server-side split"),
    (rq.errors, "errors", "Errors"),
)
SECTION_IDS = tuple(sid for _, sid, _ in SECTIONS)


def build_sections(run: RunData) -> list[Section]:
    """Every section in order; a failing builder yields a section that says so."""
    return [guarded(builder, sid, title)(run) for builder, sid, title in SECTIONS]


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes <run>/report.html (or `out`) from the run folder's files; returns its path.

    Raises `RunFolderError` when `run_dir` is not a folder; never for missing files.
    """
    run = load_run(run_dir)
    wl = (run.config or {}).get("workload") or {}
    subtitle = f"run folder: {run.path.resolve()}"
    if wl:
        subtitle += " · workload: " + ", ".join(f"{k}={v}" for k, v in list(wl.items())[:6])
    machine = machine_line(run.summary or {})
    if machine:
        subtitle += " · " + machine
    path = Path(out) if out else run.path / "report.html"
    link = history_link(run.path)
    return render_page(f"servelab run report: {run.name}", subtitle, build_sections(run), path,
                       first_screen_alerts(run.summary or {}), [link] if link else [])


def history_link(run_dir: Path) -> Link | None:
    """The header's link to the run's history page, where the run was recorded in a history store
    (history/run_link.py writes history.html and history.json into the folder); None otherwise, or
    when either file is missing or unreadable."""
    try:
        meta = json.loads((run_dir / "history.json").read_text())
        page = str(meta["report"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (run_dir / page).is_file():
        return None
    regressions = f", {meta.get('regressions')} of them regressions" if meta.get("regressions") else ""
    dirty = "; this run's checkout had uncommitted changes, so it is not in the series" if meta.get("dirty") else ""
    text = (f"Recorded in the history store {meta.get('store', '?')}: {meta.get('series', '?')} series of this "
            f"config on this machine over {meta.get('commits', '?')} commit(s), {meta.get('change_points', '?')} "
            f"change point(s){regressions} as of {meta.get('written_at', '?')}{dirty}.")  # fmt: skip
    return Link(text, "Performance history", page)


def machine_line(summary: dict[str, Any]) -> str:
    """What ran, for the header: dtype, the CPU kernels chosen and the CPU's kernel-relevant flags
    (summary.json's `dtype`, `float32_linear` / `bfloat16_linear`, `block_linear`, `cpu_flags`)."""
    keys = ("dtype", "float32_linear", "bfloat16_linear", "block_linear", "cpu_flags")
    return ", ".join(f"{k}={summary[k]}" for k in keys if summary.get(k))


def first_screen_alerts(summary: dict[str, Any]) -> list[str]:
    """The alerts a reader must see before any figure: a saturated run (its latencies grow with the
    run's length, not the load), and a run in which no request met its SLOs."""
    alerts = []
    if summary.get("saturated"):
        alerts.append(f"Saturated: the target no longer kept up ({summary.get('saturation', '')}); its latency "
                      "figures grow with the run's length, not with the load. Lower the rate or the concurrency.")
    if summary.get("request_goodput") == 0 and summary.get("completed"):
        alerts.append("No request met its SLOs (goodput 0): this load is past what the target serves within "
                      "them; see 'SLO misses by cause'.")
    return alerts
