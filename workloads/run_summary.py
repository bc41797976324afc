"""A run's results into its folder: requests.csv, steps.csv, step_members.csv and summary.json (with
what ran: the dtype and linear kernels an engine chose, external-KV totals, compile time, a partial run's
reason), whichever target produced them (workloads/experiment.py runs it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from analysis import runfolder
from analysis.metrics import summarize
from analysis.step_members import members_frame, write_members
from conf.schema import RunConfig
from workloads.driver import RunResult
from workloads.saturation import run_health
from workloads.targets.registry import target_kind
from workloads.time_reference import reference_cores


def slo_of(cfg: RunConfig) -> dict[str, float | None]:
    """The run's SLO limits (ms; None where unset), as summarize and the partial-run recovery take them."""
    return {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms, "e2el_ms": cfg.slo.e2el_ms}


KV_STEP_TOTALS = ("kv_blocks_loaded", "kv_blocks_saved", "kv_bytes_loaded", "kv_bytes_saved", "kv_load_time",
                  "kv_save_time", "kv_external_hit_tokens", "kv_load_failures")  # fmt: skip


def kv_connector_summary(run_dir: Path, steps_df: Any) -> dict[str, Any]:
    """External-KV totals: from steps.csv (an engine in this process), and per instance from
    pd_instances.json (target=pd). Empty when no connector moved anything."""
    out: dict[str, Any] = {}
    if steps_df is not None and "kv_blocks_loaded" in steps_df:
        totals = {k: float(steps_df[k].sum()) for k in KV_STEP_TOTALS if k in steps_df}
        if any(totals.values()):
            out["kv_connector"] = totals
    pd_file = run_dir / "pd_instances.json"
    if pd_file.exists():
        out["kv_connector_instances"] = json.loads(pd_file.read_text())
    return out


def write_results(
    cfg: RunConfig, run_dir: Path, result: RunResult, reference: float | None, compile_time_s: float | None = None,
    own: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """requests.csv, steps.csv (the engine's, or scraped from a server's /metrics) and summary.json
    of a finished (or stopped) run; error.txt where it stopped early. What summary.json holds beyond
    every run's figures follows the target's kind (workloads/targets/registry.py), `own` last (the
    kind's own keys). Returns the summary."""
    kind = target_kind(cfg.target.kind)
    runfolder.write_requests(run_dir, result.records)
    steps_df = None
    if result.steps:
        steps_df = runfolder.steps_frame(result.steps, result.t0_wall)
    elif result.scraped:
        steps_df = runfolder.scraped_frame(result.scraped)
    if steps_df is not None:
        runfolder.write_steps(run_dir, steps_df)
    summary = summarize(result.records, slo=slo_of(cfg), steps=steps_df)
    members = members_frame(result.steps or [])
    if write_members(run_dir, members) is not None and "slo_misses" in summary:
        from analysis.attribution import attribute, miss_summary

        # attributed again from each request's own steps (summarize saw no members)
        summary.update(miss_summary(attribute(result.records, steps_df, slo_of(cfg), members)))
    if reference is not None:
        summary["time_reference_s"] = reference
        summary["time_reference_cores"] = reference_cores(cfg)
    summary["target"] = cfg.target.kind
    summary.update(run_health(cfg, result.records))  # saturated? (workloads/saturation.py)
    if result.metrics_error:
        summary["server_metrics"] = f"unavailable: {result.metrics_error}"
    if kind.model_dtype:  # the dtype that ran ("auto" resolved, engine/platform.py)
        from engine.platform import resolve_device, resolve_engine_dtype

        summary["dtype"] = resolve_engine_dtype(cfg.model.dtype, cfg.device.device, cfg.model.model)
        on_cpu = kind.engine and resolve_device(cfg.device.device, check=False).type == "cpu"
        if on_cpu:  # the linears' kernel, and which weights each step size multiplied
            from engine.kernels import options
            from engine.kernels.isa import kernel_cpu_flags
            from engine.kernels.kernel_choices import cpu_linear_choice
            from engine.model.loader import planned_step_weights

            options.configure(cfg.kernels)  # what the run's engine ran with (its config's kernels section)
            summary.update(cpu_linear_choice(summary["dtype"]))
            summary["cpu_flags"] = kernel_cpu_flags()
            summary["linear_weights"] = planned_step_weights(cfg.model, summary["dtype"])
            summary["batch_invariant"] = cfg.model.batch_invariant
    summary.update(kv_connector_summary(run_dir, steps_df))
    if compile_time_s is not None:
        # Start-up compile + warm-up (enforce_eager=False); never inside a throughput figure.
        summary["compile_time_s"] = compile_time_s
    if result.interrupted:
        summary["stop_reason"] = result.stop_reason
        summary["partial"] = True
        runfolder.write_error(run_dir, f"run stopped early: {result.stop_reason}")
    summary.update(own or {})
    runfolder.write_summary(run_dir, summary)
    return summary
