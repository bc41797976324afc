"""Sweep report: <sweep>/report.html from <sweep>/sweep.csv.

sweep.csv has one row per job: the swept override values (columns named like the
overrides, e.g. `workload.arrival.rate`, `attention.backend` or
`attention` when the group is swept), the job's summary.json
scalars, and `run_dir`. Swept columns are those that are neither summary keys nor
`run_dir`; a column whose name ends in `request_rate` (or `rate`) is the load axis.
SLOs come from the first job's config.yaml, else `fallback_slo` of the report options.
The report options (`report:`) are the sweep's own: passed in by the sweep collector, else
read from the first job's config.yaml, else the packaged conf/report/default.yaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import yaml

import conf
from reports.page import Section, guarded, html_table, new_figure, render, render_page
from reports.pareto import sweep_section as pareto
from reports.run_data import RunFolderError, load_run

REPORT_CONFIG = Path(conf.__file__).parent / "report" / "default.yaml"
SUMMARY_RE = (r"^(completed|failed|duration|total_.*|request_.*|output_throughput|max_.*|mean_.*|median_.*|std_.*"
              r"|p\d+_.*|driver_bottleneck|num_.*|prefix_cache_hit_rate|time_reference_s|reference_ratio_.*"
              r"|saturat.*|steady_.*)$")  # fmt: skip


NOT_SWEPT = {"job", "run_dir", "target", "error", "stop_reason", "simulation_wall_s"}


def swept_columns(df: pd.DataFrame) -> list[str]:
    """Override columns (not summary metrics, not bookkeeping) whose value changes across jobs."""
    cols = [c for c in df.columns if c not in NOT_SWEPT and not pd.Series([c]).str.match(SUMMARY_RE).item()]
    varying = [c for c in cols if df[c].astype(str).nunique() > 1]
    return varying or cols


def _rate_column(swept: list[str]) -> str | None:
    return next((c for c in swept if c.endswith("request_rate") or c.endswith("rate")), None)


def _slo(df: pd.DataFrame, cfg: dict[str, Any]) -> dict[str, float]:
    if "run_dir" in df and len(df):
        try:
            slo = load_run(df["run_dir"].iloc[0]).slo()
            if slo:
                return slo
        except RunFolderError:
            pass
    return {k: float(v) for k, v in (cfg.get("fallback_slo") or {}).items() if v is not None}


def _series(df: pd.DataFrame, swept: list[str], rate: str | None):
    """(label, rows sorted by the load axis) per combination of the other swept values."""
    others = [c for c in swept if c != rate]
    groups = df.groupby(others) if others else [((), df)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{c}={v}" for c, v in zip(others, key, strict=True)) or "all jobs"
        yield label, (g.sort_values(rate) if rate else g)


def curves(df: pd.DataFrame, swept: list[str], cfg: dict[str, Any]) -> Section:
    s = Section("throughput-latency", "Throughput vs latency",
                intro="One line per combination of the non-load swept values, points ordered by load.")  # fmt: skip
    rate, tput = _rate_column(swept), cfg["sweep"]["throughput_metric"]
    lat = [m for m in cfg["sweep"]["latency_metrics"] if m in df]
    fig, axes = new_figure(5 * len(lat), 3.2, ncols=len(lat))
    for ax, metric in zip(axes, lat, strict=True):
        for label, g in _series(df, swept, rate):
            ax.plot(g[tput], g[metric], marker="o", label=label)
        ax.set_xlabel(tput)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    s.figures.append(
        render(fig, "Throughput-latency curves", f"{tput} against tail latency for each swept configuration.")
    )
    if rate and "request_goodput" in df:
        fig, (ax,) = new_figure(6, 3)
        for label, g in _series(df, swept, rate):
            ax.plot(g[rate], g["request_goodput"], marker="o", label=label)
        ax.plot(df[rate], df[rate], ":", color="gray", label="offered load")
        ax.set_xlabel(rate)
        ax.set_ylabel("request_goodput (req/s)")
        ax.legend(fontsize=8)
        s.figures.append(
            render(fig, "Goodput vs request rate", "Requests/s meeting every SLO at each offered rate.")
        )
    return s


def backends(df: pd.DataFrame, swept: list[str], cfg: dict[str, Any]) -> Section:
    s = Section("attention-backends", "Attention backends side by side")
    col = next((c for c in swept if c.endswith("attention.backend") or c == "attention"), None)
    if col is None:
        s.missing = "attention.backend was not swept."
        return s
    metrics = [m for m in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms") if m in df]
    table = df.groupby(col)[metrics].median()
    fig, axes = new_figure(4 * len(metrics), 3, ncols=len(metrics))
    for ax, m in zip(axes, metrics, strict=True):
        ax.bar(table.index.astype(str), table[m])
        ax.set_ylabel(m)
    s.figures.append(
        render(fig, "Backends", "Median over the other swept values of each metric per attention backend.")
    )
    s.tables.append(html_table(table, index=True))
    return s


def best(df: pd.DataFrame, swept: list[str], cfg: dict[str, Any]) -> Section:
    s = Section("best-config", "Best configuration under the SLOs")
    slo = _slo(df, cfg)
    ok = pd.Series(True, index=df.index)
    for key, limit in slo.items():
        col = f"p99_{key}"
        if col in df:
            ok &= df[col] <= limit
    s.intro = "SLOs: " + (", ".join(f"p99 {k} <= {v:g}" for k, v in slo.items()) or "none configured")
    # A saturated run's figures describe a target that no longer kept up (they grow with the run's
    # length), and a failed or skipped job has none: neither can be the configuration to deploy.
    if "saturated" in df:
        saturated = df["saturated"].astype(object).fillna(False).astype(bool)
        if saturated.any():
            s.intro += f"; {int(saturated.sum())} saturated job(s) excluded"
        ok &= ~saturated
    if "error" in df:
        ok &= df["error"].astype(object).fillna("").astype(str).str.len() == 0
    by = cfg["sweep"]["best_by"] if cfg["sweep"]["best_by"] in df else "output_throughput"
    fit = df[ok]
    if fit.empty:
        s.missing = "No finished, unsaturated job met the SLOs."
        return s
    top = fit.sort_values(by, ascending=False).head(1)
    s.alert = "Best: " + ", ".join(f"{c}={top[c].item()}" for c in swept) + f" ({by} = {top[by].item():.4g})"
    return s


def failed_jobs(df: pd.DataFrame, swept: list[str], cfg: dict[str, Any]) -> Section:
    s = Section("failed-jobs", "Failed jobs")
    if "error" not in df or not df["error"].astype(object).fillna("").astype(str).str.len().any():
        s.missing = "Every job finished without an error."
        return s
    bad = df[df["error"].astype(object).fillna("").astype(str).str.len() > 0]
    s.alert = f"{len(bad)} of {len(df)} jobs failed or stopped early."
    s.tables.append(html_table(bad[[c for c in ("job", *swept, "error", "run_dir") if c in bad]]))
    return s


def targets(df: pd.DataFrame, swept: list[str], cfg: dict[str, Any]) -> Section:
    """servelab and peer engines (target=server,vllm) on the same workload, side by side."""
    s = Section("targets", "Engines side by side")
    # the summary's `target` (the kind that ran) is bookkeeping, not a swept column
    col = next((c for c in ("target", "target.kind") if c in df and df[c].astype(str).nunique() > 1), None)
    if col is None:
        s.missing = "target was not swept (e.g. -m target=server,vllm)."
        return s
    metrics = [m for m in ("output_throughput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms",
                           "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "completed", "failed") if m in df]
    table = df.groupby(col)[metrics].median()
    s.intro = "Same workload on each target; the median over the other swept values."
    s.tables.append(html_table(table, index=True))
    plot = [m for m in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms") if m in table]
    if plot:
        fig, axes = new_figure(4 * len(plot), 3, ncols=len(plot))
        for ax, m in zip(axes, plot, strict=True):
            ax.bar(table.index.astype(str), table[m])
            ax.set_ylabel(m)
        s.figures.append(render(fig, "Targets", "Each metric per target (servelab and its peers)."))
    return s


def report_options(df: pd.DataFrame) -> dict[str, Any]:
    """The `report:` section of the first job's config.yaml, else the packaged defaults."""
    if "run_dir" in df and len(df):
        cfg_path = Path(str(df["run_dir"].iloc[0])) / "config.yaml"
        if cfg_path.exists():
            section = (yaml.safe_load(cfg_path.read_text()) or {}).get("report")
            if isinstance(section, dict) and section:
                return section
    return yaml.safe_load(REPORT_CONFIG.read_text())


def build_sweep_report(sweep_dir: str | Path, config: dict[str, Any] | None = None) -> Path:
    """Writes <sweep>/report.html; raises RunFolderError when sweep.csv is missing.

    `config`: the sweep's `report:` options (see the module docstring when None).
    """
    root = Path(sweep_dir)
    if not (root / "sweep.csv").exists():
        raise RunFolderError(f"no sweep.csv in {root}")
    df = pd.read_csv(root / "sweep.csv")
    cfg = config or report_options(df)
    swept = swept_columns(df)
    jobs = Section("jobs", "Jobs", intro=f"{len(df)} jobs; swept: {', '.join(swept) or 'nothing'}.",
                   tables=[html_table(df[[*swept, *[c for c in ("output_throughput", "request_goodput", "p99_ttft_ms", "p99_tpot_ms") if c in df]]])])  # fmt: skip
    sections = [jobs] + [guarded(f, sid, t)(df, swept, cfg) for f, sid, t in (
        (curves, "throughput-latency", "Throughput vs latency"),
        (backends, "attention-backends", "Attention backends side by side"),
        (best, "best-config", "Best configuration under the SLOs"),
        (pareto, "pareto", "Pareto front: speed per user against throughput per instance"),
        (targets, "targets", "Engines side by side"),
        (failed_jobs, "failed-jobs", "Failed jobs"))]  # fmt: skip
    return render_page(
        f"servelab sweep report: {root.name}", str(root.resolve()), sections, root / "report.html"
    )
