"""Report sections from the engine side: steps.csv, kernels.csv, telemetry.csv/json.

steps.csv comes in two shapes: engine step stats (one row per step) or, for HTTP
targets, a scraped /metrics series (`source == "metrics"`, only time, num_running,
num_waiting, kv_usage and whatever else). Sections use what is there.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from reports.kernel_summary import kernel_breakdown
from reports.page import Figure, Section, html_table, new_figure, render
from reports.run_data import RunData


def _kv_usage(steps: pd.DataFrame) -> pd.Series | None:
    if "kv_usage" in steps:
        return steps["kv_usage"].astype(float)
    if {"kv_blocks_used", "kv_blocks_total"} <= set(steps):
        return steps["kv_blocks_used"] / steps["kv_blocks_total"].replace(0, np.nan)
    return None


def _group_blocks(steps: pd.DataFrame) -> pd.DataFrame | None:
    """Blocks held per KV cache group after each step (a column per group), from steps.csv's
    `kv_blocks_used_per_group` (a JSON list per row; engine/kv_cache_spec.py); None with one group."""
    if "kv_blocks_used_per_group" not in steps:
        return None
    rows = [json.loads(v) if isinstance(v, str) and v else (list(v) if isinstance(v, list) else [])
            for v in steps["kv_blocks_used_per_group"]]  # fmt: skip
    width = max((len(r) for r in rows), default=0)
    if width < 2:
        return None
    return pd.DataFrame([r + [0] * (width - len(r)) for r in rows], columns=[f"group {g}" for g in range(width)])


def kv_and_batch(run: RunData) -> Section:
    s = Section("kv-batch", "KV-cache utilization and batch composition",
                intro="Engine state per step (or per /metrics scrape for HTTP targets), by time since run start.")  # fmt: skip
    steps = run.steps
    if steps is None or steps.empty or "time" not in steps:
        s.missing = (
            f"No engine state: steps.csv is {run.problems.get('steps.csv', 'empty or has no time column')}."
        )
        return s
    t = steps["time"].astype(float)
    kv = _kv_usage(steps)
    if kv is not None:
        fig, (ax,) = new_figure(7, 2.4)
        ax.plot(t, kv * 100)
        ax.set_ylim(0, 105)
        ax.set_ylabel("KV cache used (%)")
        ax.set_xlabel("time (s)")
        s.figures.append(
            render(fig, "KV-cache utilization", "Share of KV-cache blocks in use after each step.")
        )
    groups = _group_blocks(steps)
    if groups is not None:
        fig, (ax,) = new_figure(7, 2.4)
        for name in groups:
            ax.step(t, groups[name], where="post", label=name + (" (full attention)" if name == "group 0" else ""))
        ax.set_ylabel("KV blocks held")
        ax.set_xlabel("time (s)")
        ax.legend()
        s.figures.append(render(
            fig, "KV-cache blocks per group",
            "Blocks held in each KV cache group after each step (one shared pool): group 0 holds every position "
            "of a request, a sliding-window group only the window's blocks."))  # fmt: skip
    if {"num_prefill_tokens", "num_decode_tokens"} <= set(steps):
        fig, (ax,) = new_figure(7, 2.6)
        ax.fill_between(t, 0, steps["num_decode_tokens"], step="post", label="decode tokens", alpha=0.7)
        ax.fill_between(t, steps["num_decode_tokens"], steps["num_decode_tokens"] + steps["num_prefill_tokens"],
                        step="post", label="prefill tokens", alpha=0.7)  # fmt: skip
        ax.set_ylabel("tokens per step")
        ax.set_xlabel("time (s)")
        ax.legend()
        s.figures.append(
            render(fig, "Batch composition", "Tokens scheduled per step, decode vs prefill (stacked).")
        )
    if {"num_running", "num_waiting"} <= set(steps):
        fig, (ax,) = new_figure(7, 2.4)
        ax.step(t, steps["num_running"], where="post", label="running")
        ax.step(t, steps["num_waiting"], where="post", label="waiting")
        ax.set_ylabel("requests")
        ax.set_xlabel("time (s)")
        ax.legend()
        s.figures.append(
            render(fig, "Running vs waiting", "Requests in the running batch and in the waiting queue.")
        )
    spec = _speculation_figure(steps, t)
    if spec is not None:
        s.figures.append(spec)
    if "source" in steps and (steps["source"] == "metrics").any():
        s.notes.append("Engine state scraped from the server's /metrics endpoint (no per-step stats).")
    return s


def _speculation_figure(steps: pd.DataFrame, t: pd.Series) -> Figure | None:
    """Speculative decoding acceptance over time (steps.csv of a run with speculative_config)."""
    if not {"num_draft_tokens", "num_accepted_tokens"} <= set(steps) or steps["num_draft_tokens"].sum() <= 0:
        return None
    drafts, accepted = steps["num_draft_tokens"].astype(float), steps["num_accepted_tokens"].astype(float)
    fig, (ax,) = new_figure(7, 2.4)
    ax.plot(t, accepted.cumsum() / drafts.cumsum().replace(0, np.nan) * 100, label="so far")
    per_step = (accepted / drafts.replace(0, np.nan) * 100).rolling(20, min_periods=1).mean()
    ax.plot(t, per_step, alpha=0.6, label="last 20 steps")
    ax.set_ylim(0, 105)
    ax.set_ylabel("draft acceptance (%)")
    ax.set_xlabel("time (s)")
    ax.legend()
    return render(fig, "Speculative decoding acceptance",
                  "Accepted / verified draft tokens: cumulative, and a rolling mean over 20 steps.")


def preemption_prefix(run: RunData) -> Section:
    s = Section("preemption-prefix", "Preemptions and prefix-cache hit rate",
                intro="Cumulative preemptions and prefix-cache hit rate (tokens hit / tokens queried) over the run.")  # fmt: skip
    sm, steps = run.summary or {}, run.steps
    rows = [(k, sm[k]) for k in ("num_preemptions", "prefix_cache_hit_rate") if k in sm]
    if rows:
        s.tables.append(html_table(pd.DataFrame(rows, columns=["metric", "value"])))
    cols = {"time", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits"}
    if steps is None or not cols <= set(steps):
        if not rows:
            s.missing = "No preemption or prefix-cache data (no engine step stats in this run)."
        else:
            s.notes.append("No per-step series (no engine step stats in this run).")
        return s
    t = steps["time"].astype(float)
    fig, (ax,) = new_figure(7, 2.6)
    ax.step(t, steps["num_preemptions"].cumsum(), where="post", label="preemptions (cumulative)")
    ax.set_ylabel("preemptions")
    ax.set_xlabel("time (s)")
    ax2 = ax.twinx()
    queries = steps["prefix_cache_queries"].cumsum().replace(0, np.nan)
    ax2.plot(t, steps["prefix_cache_hits"].cumsum() / queries * 100, color="tab:green", label="hit rate")
    ax2.set_ylabel("prefix-cache hit rate (%)")
    s.figures.append(render(fig, "Preemptions and prefix hits",
                            "Blue: preemptions so far; green: prefix-cache hit rate so far (tokens hit / queried)."))  # fmt: skip
    return s


def kernels(run: RunData) -> Section:
    s = Section("kernels", "Kernel-time breakdown",
                intro="Time per category in the profiled steps (torch.profiler: CUDA kernels on GPU, "
                      "aten-op self time on CPU; on CPU, 'host' is each phase's time outside every op: "
                      "Python and dispatch).")  # fmt: skip
    if run.kernels is None or run.kernels.empty:
        s.missing = "No profile recorded (kernels.csv absent: profiling was off for this run)."
        return s
    per_step, totals = kernel_breakdown(run.kernels, run.steps)
    fig, (ax,) = new_figure(7, 2.8)
    bottom = np.zeros(len(per_step))
    x = np.arange(len(per_step))
    for cat in per_step.columns:
        ax.bar(x, per_step[cat], bottom=bottom, label=cat)
        bottom += per_step[cat].to_numpy()
    ax.set_xticks(x, [str(i) for i in per_step.index])
    ax.set_xlabel("profiled step")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8, ncol=3)
    s.figures.append(render(fig, "Kernel time per step", "Stacked time per category in each profiled step."))
    s.tables.append(html_table(totals))
    return s


def _gpu_figure(tel: pd.DataFrame) -> list:
    fig, axes = new_figure(11, 2.6, ncols=4)
    cols = (("gpu_util_pct", "GPU util (%)"), ("gpu_mem_used_mb", "memory used (MB)"),
            ("gpu_power_w", "power (W)"), ("sm_clock_mhz", "SM clock (MHz)"))  # fmt: skip
    for ax, (col, label) in zip(axes, cols, strict=True):
        for idx, g in tel.groupby("gpu_index"):
            ax.plot(g["time"], g[col], label=f"GPU {int(idx)}")
        ax.set_ylabel(label)
        ax.set_xlabel("time (s)")
    axes[0].legend(fontsize=8)
    return [
        render(fig, "GPU telemetry", "NVML samples per GPU: utilization, memory used, power and SM clock.")
    ]


def telemetry(run: RunData) -> Section:
    s = Section("telemetry", "GPU and host telemetry", intro="Sampled in a background thread during the run.")
    info, tel = run.telemetry_info or {}, run.telemetry
    has_gpu = tel is not None and "gpu_util_pct" in tel and tel["gpu_util_pct"].notna().any()
    if has_gpu:
        s.figures += _gpu_figure(tel[tel["gpu_index"].notna()])
    else:
        reason = info.get("reason") or run.problems.get("telemetry.json", "no telemetry recorded")
        s.notes.append(f"no GPU telemetry: {reason}")
    if tel is not None and {"time", "cpu_util_pct", "rss_mb"} <= set(tel):
        host = tel.drop_duplicates("time")
        fig, (ax,) = new_figure(7, 2.4)
        ax.plot(host["time"], host["cpu_util_pct"], label="CPU util (%)")
        ax.set_ylabel("CPU util (%)")
        ax.set_xlabel("time (s)")
        ax2 = ax.twinx()
        ax2.plot(host["time"], host["rss_mb"], color="tab:red", label="RSS (MB)")
        ax2.set_ylabel("RSS (MB)")
        s.figures.append(
            render(
                fig,
                "Host telemetry",
                "System CPU utilization (blue) and the process's resident memory (red).",
            )
        )
    elif tel is None:
        s.notes.append(f"No host telemetry: telemetry.csv is {run.problems.get('telemetry.csv', 'missing')}.")
    return s
