"""Tables from kernels.csv (step, category, time_ms), joined to steps.csv on step."""

from __future__ import annotations

import pandas as pd

CATEGORY_ORDER = ["gemm", "attention", "norm_act", "sampling", "copy", "other"]


def kernel_breakdown(kernels: pd.DataFrame, steps: pd.DataFrame | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-step pivot [step x category] in ms, totals per category with share in %).

    When steps.csv has forward_time for the profiled steps, the totals table gains a
    row comparing the summed kernel time with the engine's measured forward time.
    """
    pivot = kernels.pivot_table(
        index="step", columns="category", values="time_ms", aggfunc="sum", fill_value=0.0
    )
    order = [c for c in CATEGORY_ORDER if c in pivot.columns] + [
        c for c in pivot.columns if c not in CATEGORY_ORDER
    ]
    pivot = pivot[order]
    totals = pivot.sum().rename("total_ms").to_frame()
    totals["share_pct"] = totals["total_ms"] / totals["total_ms"].sum() * 100
    totals["per_step_ms"] = totals["total_ms"] / len(pivot)
    totals = totals.rename_axis("category").reset_index()
    if steps is not None and {"step", "forward_time"} <= set(steps):
        fwd = steps.set_index("step")["forward_time"].reindex(pivot.index) * 1e3
        if fwd.notna().any():
            row = {"category": "engine forward_time (steps.csv)", "total_ms": fwd.sum(),
                   "share_pct": float("nan"), "per_step_ms": fwd.mean()}  # fmt: skip
            totals = pd.concat([totals, pd.DataFrame([row])], ignore_index=True)
    return pivot, totals
