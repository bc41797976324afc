"""Report sections computed from requests.csv, summary.json and config.yaml.

Each builder takes a `RunData` and returns a `Section`; missing inputs give a section
whose `missing` text says which file is absent.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import yaml

from analysis.runfolder import json_list
from reports.page import Section, html_table, new_figure, render
from reports.run_data import RunData

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))
PERCENTILES = (50, 90, 95, 99)


def _no(file: str, run: RunData) -> str:
    why = run.problems.get(file, "missing")
    return f"No data: {file} is {why}."


def workload_config(run: RunData) -> Section:
    s = Section("workload-config", "Workload and configuration",
                intro="The resolved configuration of the run (workload, target, engine, SLOs).")  # fmt: skip
    if run.config is None:
        s.missing = _no("config.yaml", run)
        return s
    rows = [(k, yaml.safe_dump(run.config.get(k), default_flow_style=True, width=200).strip())
            for k in ("workload", "target", "engine", "slo") if k in run.config]  # fmt: skip
    s.tables.append(html_table(pd.DataFrame(rows, columns=["group", "values"])))
    if run.error:
        s.alert = "This run did not finish cleanly (error.txt present): numbers cover what was measured."
    return s


def summary_table(run: RunData) -> Section:
    s = Section("summary", "Summary", intro="Aggregates from summary.json: vLLM-named keys with vLLM's "
                "definitions (client clock, per chunk); per-token and engine figures on lines of their own.")
    if run.summary is None:
        s.missing = _no("summary.json", run)
        return s
    sm = run.summary
    # vLLM's keys (client clock, per chunk), then the per-token and engine figures on lines of their own
    keys = ["completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "request_goodput", "max_output_tokens_per_s", "peak_output_tokens_per_s",
            "max_concurrent_requests", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
            "median_itl_per_token_ms", "p99_itl_per_token_ms", "engine_median_itl_ms", "engine_p99_itl_ms",
            "engine_median_tpot_ms", "engine_median_e2el_ms", "num_steps", "mean_tokens_per_step",
            "num_preemptions", "prefix_cache_hit_rate"]  # fmt: skip
    defs = sm.get("definitions") or {}
    rows = [(k, sm[k], definition_of(k, defs)) for k in keys if k in sm]
    s.tables.append(html_table(pd.DataFrame(rows, columns=["metric", "value", "definition"])))
    return s


def definition_of(key: str, definitions: dict[str, str]) -> str:
    """The definition of a summary key: its own entry, else its family's (`engine_p99_itl_ms` ->
    `engine_itl`, `median_itl_per_token_ms` -> `itl_per_token`)."""
    if key in definitions:
        return definitions[key]
    m = re.fullmatch(r"(engine_)?(?:mean|median|std|p\d+)_(\w+)_ms", key)
    return definitions.get(f"{m[1] or ''}{m[2]}", "") if m else ""


def _latency_values(req: pd.DataFrame, key: str) -> np.ndarray:
    if key == "itl_ms":  # vLLM's ITL: every gap between content chunks, pooled
        gaps = [g for cell in req.get("itls_ms", pd.Series(dtype=object)) for g in json_list(cell)]
        return np.asarray(gaps, dtype=float)
    if key not in req:
        return np.asarray([], dtype=float)
    return pd.to_numeric(req[key], errors="coerce").dropna().to_numpy()


def distributions(run: RunData) -> Section:
    s = Section("latency-distributions", "Latency distributions (TTFT, TPOT, ITL, E2EL)",
                intro="Completed, non-warm-up requests; vLLM's definitions (client clock): ITL pooled over "
                      "all gaps between content chunks (per chunk, not per token).")  # fmt: skip
    req = run.completed_requests()
    if req is None:
        s.missing = _no("requests.csv", run)
        return s
    fig, axes = new_figure(11, 2.8, ncols=4)
    rows = []
    for ax, (key, label) in zip(axes, LATENCIES, strict=True):
        v = np.sort(_latency_values(req, key))
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v))
            rows.append((label, len(v), v.mean(), *np.percentile(v, PERCENTILES), v.max()))
        for name, value in run.slo().items():
            if name == key:
                ax.axvline(value, color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.grid(alpha=0.3)
    s.figures.append(render(fig, "Latency CDFs",
                            "Cumulative share of requests (gaps for ITL) at or below each latency; red dashed line = SLO."))  # fmt: skip
    cols = ["metric", "n", "mean", *[f"p{p}" for p in PERCENTILES], "max"]
    s.tables.append(html_table(pd.DataFrame(rows, columns=cols)))
    return s


def over_time(run: RunData) -> Section:
    s = Section("over-time", "Latency and throughput over time",
                intro="Time is seconds since the run started (client clock).")  # fmt: skip
    req = run.completed_requests()
    if req is None or req.empty:
        s.missing = _no("requests.csv", run) if req is None else "No completed request."
        return s
    fig, (ax,) = new_figure()
    start = req["start_s"].astype(float)
    ax.scatter(start, req["ttft_ms"].astype(float), s=8, label="TTFT")
    ax.scatter(start, req["e2el_ms"].astype(float), s=8, label="E2EL")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("ms")
    ax.legend()
    ax.grid(alpha=0.3)
    s.figures.append(
        render(
            fig, "Latency by send time", "Each dot is one request's TTFT or E2EL, placed at its send time."
        )
    )
    times = np.asarray([t for cell in req.get("token_times", []) for t in json_list(cell)])
    if len(times):
        fig, (ax,) = new_figure()
        bins = np.arange(np.floor(times.min()), np.ceil(times.max()) + 1.0)
        counts, edges = np.histogram(times, bins=bins)
        ax.step(edges[:-1], counts, where="post", label="output tokens/s")
        done, _ = np.histogram(req["end_s"].astype(float), bins=bins)
        ax2 = ax.twinx()
        ax2.step(edges[:-1], done, where="post", color="tab:orange", label="requests done/s")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("output tokens/s")
        ax2.set_ylabel("requests completed/s")
        s.figures.append(
            render(
                fig,
                "Throughput",
                "Output tokens received (blue) and requests completed (orange) per 1-second bin.",
            )
        )
    return s


def client_lateness(run: RunData) -> Section:
    s = Section("client-lateness", "Client lateness check",
                intro="Lateness = actual send − planned send when the driver itself was late; "
                      "client queue = waiting for a concurrency slot.")  # fmt: skip
    sm, req = run.summary or {}, run.measured_requests()
    if not sm and req is None:
        s.missing = "No data: summary.json and requests.csv are missing."
        return s
    keys = ("mean_lateness_ms", "p99_lateness_ms", "max_lateness_ms", "mean_client_queue_ms")
    rows = [(k, sm[k]) for k in keys if k in sm]
    if rows:
        s.tables.append(html_table(pd.DataFrame(rows, columns=["metric", "value"])))
    if sm.get("driver_bottleneck"):
        s.alert = ("The load driver WAS the bottleneck: requests were sent late, so latencies and "
                   "throughput understate what the server can do. Rerun with a faster driver or lower load.")  # fmt: skip
    elif "driver_bottleneck" in sm:
        s.notes.append(f"The driver kept up (p99 lateness {sm.get('p99_lateness_ms', float('nan')):.3g} ms): "
                       "the numbers measure the server, not the client.")  # fmt: skip
    if req is not None and "lateness_ms" in req and "scheduled_s" in req:
        fig, (ax,) = new_figure(7, 2.6)
        ax.plot(req["scheduled_s"].astype(float), req["lateness_ms"].astype(float), ".", markersize=4)
        ax.set_xlabel("planned send time (s)")
        ax.set_ylabel("lateness (ms)")
        ax.grid(alpha=0.3)
        s.figures.append(
            render(fig, "Driver lateness", "How late the driver sent each request relative to its schedule.")
        )
    return s


def goodput(run: RunData) -> Section:
    s = Section("goodput", "Goodput vs SLOs",
                intro="Goodput = completed requests meeting every configured SLO / duration.")  # fmt: skip
    slo, req, sm = run.slo(), run.completed_requests(), run.summary or {}
    if not slo:
        s.missing = "No SLO configured (config.yaml slo.* are null or absent)."
        return s
    if req is None:
        s.missing = _no("requests.csv", run)
        return s
    rows, meets = [], pd.Series(True, index=req.index)
    for key, limit in slo.items():
        ok = pd.to_numeric(req[key], errors="coerce") <= limit
        meets &= ok
        rows.append((key, limit, ok.mean() * 100 if len(ok) else float("nan")))
    rows.append(("all SLOs", None, meets.mean() * 100 if len(meets) else float("nan")))
    s.tables.append(
        html_table(pd.DataFrame(rows, columns=["SLO", "limit (ms)", "% of completed meeting it"]))
    )
    if "request_goodput" in sm:
        s.notes.append(f"request_goodput = {sm['request_goodput']:.4g} req/s vs request_throughput = "
                       f"{sm.get('request_throughput', float('nan')):.4g} req/s.")  # fmt: skip
    return s


def server_split(run: RunData) -> Section:
    s = Section("server-split", "Server-side split (queued / prefill / decode)",
                intro="Engine timestamps per request: time waiting in the server queue, prefill, decode.")  # fmt: skip
    req = run.completed_requests()
    cols = ["server_queued_ms", "server_prefill_ms", "server_decode_ms"]
    if req is None or any(c not in req for c in cols) or req[cols].isna().all().all():
        s.missing = "No server-side timestamps in this run (the target exposes none)."
        return s
    parts = req[cols].apply(pd.to_numeric, errors="coerce").fillna(0.0)
    parts = parts.assign(total=parts.sum(axis=1)).sort_values("total")
    fig, (ax,) = new_figure()
    x, bottom = np.arange(len(parts)), np.zeros(len(parts))
    for c in cols:
        ax.bar(x, parts[c], bottom=bottom, label=c.removeprefix("server_").removesuffix("_ms"))
        bottom += parts[c].to_numpy()
    ax.set_xlabel("requests, sorted by server time")
    ax.set_ylabel("ms")
    ax.legend()
    s.figures.append(
        render(
            fig,
            "Server time per request",
            "Stacked queued/prefill/decode time of each request (server clock).",
        )
    )
    s.tables.append(html_table(parts[cols].describe().loc[["mean", "50%", "max"]].T, index=True))
    return s


def errors(run: RunData) -> Section:
    s = Section("errors", "Errors", intro="Failed requests are excluded from latency statistics.")
    if run.error:
        s.alert = "The run failed or was interrupted (error.txt)."
        s.notes.append("error.txt: " + run.error[:2000])
    req = run.measured_requests()
    if req is not None and "error" in req:
        failed = req[req["error"].astype(object).fillna("").astype(str).str.len() > 0]
        s.notes.append(f"{len(failed)} of {len(req)} measured requests failed.")
        if len(failed):
            counts = failed["error"].value_counts().rename_axis("error").reset_index(name="count")
            s.tables.append(html_table(counts))
    if run.problems:
        rows = sorted(run.problems.items())
        s.tables.append(html_table(pd.DataFrame(rows, columns=["file", "not loaded because"])))
    if not s.notes and not s.tables:
        s.notes.append("No errors recorded.")
    return s
