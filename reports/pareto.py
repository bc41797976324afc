"""The Pareto front of per-user speed against per-instance throughput (vLLM's sweep
plot_pareto, AIPerf's Pareto plots).

One point per swept configuration and load: x = output tokens/s per instance
(`output_throughput`), y = output tokens/s per user = 1000 / `mean_tpot_ms` (the decode speed
one stream sees). Where the number of devices is known (tensor-parallel ranks), x is also
given per device. A point is on the front when no other point is at least as good on both
axes and better on one: a deployer picks along the front, trading speed per user for
throughput per instance (more load, bigger batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from reports.page import Section, html_table, new_figure, render

PER_USER = "output_tok_s_per_user"
PER_INSTANCE = "output_tok_s_per_instance"
PER_DEVICE = "output_tok_s_per_device"


def front_mask(x: Sequence[float], y: Sequence[float]) -> np.ndarray:
    """True where (x[i], y[i]) is not dominated (both axes larger is better; NaN never on it)."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(xs) & np.isfinite(ys)
    mask = np.zeros(len(xs), dtype=bool)
    for i in np.flatnonzero(ok):
        better_or_equal = ok & (xs >= xs[i]) & (ys >= ys[i])
        strictly = better_or_equal & ((xs > xs[i]) | (ys > ys[i]))
        mask[i] = not strictly.any()
    return mask


def pareto_points(
    rows: pd.DataFrame, labels: Sequence[str], devices: Sequence[float | None] | None = None
) -> pd.DataFrame:
    """`config`, per-user and per-instance (and per-device where known) output tokens/s and
    `on_front`, one row per input row, from its `output_throughput` and `mean_tpot_ms`."""
    tpot = pd.to_numeric(rows["mean_tpot_ms"], errors="coerce").to_numpy(dtype=np.float64)
    out = pd.DataFrame({
        "config": list(labels),
        PER_USER: np.where(tpot > 0, 1000.0 / np.where(tpot > 0, tpot, 1.0), np.nan),
        PER_INSTANCE: pd.to_numeric(rows["output_throughput"], errors="coerce").to_numpy(dtype=np.float64),
    })  # fmt: skip
    if devices is not None and any(d for d in devices):
        out[PER_DEVICE] = [x / d if d else np.nan for x, d in zip(out[PER_INSTANCE], devices, strict=True)]
    out["on_front"] = front_mask(out[PER_INSTANCE], out[PER_USER])
    return out


def plot(points: pd.DataFrame, title: str) -> Any:
    """A matplotlib figure: every point labelled with its configuration, the front a line."""
    fig, (ax,) = new_figure(7, 4)
    ax.scatter(points[PER_INSTANCE], points[PER_USER], color="#999", s=18, label="swept point")
    front = points[points["on_front"]].sort_values(PER_INSTANCE)
    ax.plot(front[PER_INSTANCE], front[PER_USER], "o-", color="#d62728", label="Pareto front")
    for _, p in points.iterrows():
        if np.isfinite(p[PER_INSTANCE]) and np.isfinite(p[PER_USER]):
            ax.annotate(str(p["config"]), (p[PER_INSTANCE], p[PER_USER]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("output tokens/s per instance")
    ax.set_ylabel("output tokens/s per user (1000 / mean TPOT ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def job_devices(run_dir: str | Path) -> int | None:
    """Devices of a run from its config.yaml: the simulated or the engine's tensor-parallel size."""
    path = Path(str(run_dir)) / "config.yaml"
    if not path.exists():
        return None
    cfg = yaml.safe_load(path.read_text()) or {}
    tp = int((cfg.get("parallel") or {}).get("tensor_parallel_size") or 0)
    if (cfg.get("target") or {}).get("kind") == "simulated":
        tp = max(tp, int((cfg.get("sim") or {}).get("tp") or 0))
    return tp or None


def sweep_section(df: pd.DataFrame, swept: list[str], cfg: dict[str, Any]) -> Section:
    """The sweep report's section: the table of points (front first) and the labelled plot."""
    s = Section("pareto", "Pareto front: speed per user against throughput per instance")
    if not {"output_throughput", "mean_tpot_ms"} <= set(df.columns):
        s.missing = "The jobs' summaries have no output_throughput / mean_tpot_ms."
        return s
    # A job without both figures (skipped past a saturated rate, failed) is no point: left out, and counted.
    measured = (pd.to_numeric(df["output_throughput"], errors="coerce") > 0) & (
        pd.to_numeric(df["mean_tpot_ms"], errors="coerce") > 0
    )
    left_out = int((~measured).sum())
    df = df[measured]
    if df.empty:
        s.missing = f"No job has both output_throughput and mean_tpot_ms ({left_out} without figures)."
        return s
    labels = [", ".join(f"{c}={r[c]}" for c in swept) or str(r.get("job", i)) for i, r in df.iterrows()]
    devices = [job_devices(d) for d in df["run_dir"]] if "run_dir" in df else None
    points = pareto_points(df, labels, devices)
    s.intro = (f"{int(points['on_front'].sum())} of {len(points)} points on the front (no other point is "
               "faster per user and higher in throughput per instance). Per user: 1000 / mean TPOT."
               + (f" {left_out} job(s) without figures (skipped or failed) left out." if left_out else ""))  # fmt: skip
    s.figures.append(
        render(plot(points, "Pareto front"), "Pareto front", "Each point a swept job, labelled.")
    )
    s.tables.append(html_table(points.sort_values(["on_front", PER_INSTANCE], ascending=[False, False])))
    return s
