"""The run report's load-phase section: saturation, the steady-state window beside the whole
run, and time slices (workloads/saturation.py, analysis/steady_state.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.steady_state import csv_frame, in_flight, steady_window, time_slices, window_figures
from reports.page import Section, html_table, new_figure, render
from reports.run_data import RunData

COMPARED = ("output_throughput", "request_throughput", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms")  # fmt: skip
SLICE_COLUMNS = ("slice_start_s", "requests", "completed", "output_throughput", "request_throughput",
                 "mean_in_flight", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")  # fmt: skip


def load_phases(run: RunData) -> Section:
    s = Section("steady-state", "Steady state and time slices")
    if run.requests is None or run.requests.empty or "start_s" not in run.requests:
        s.missing = "No requests.csv."
        return s
    frame = csv_frame(run.requests)
    if frame.empty:
        s.missing = "No measured request."
        return s
    summary = run.summary or {}
    if summary.get("saturated"):
        s.alert = f"Saturated: the target no longer kept up ({summary.get('saturation', '')})."
    window = steady_window(frame)
    slice_s = ((run.config or {}).get("run") or {}).get("time_slice_s")
    slices = time_slices(frame, float(slice_s) if slice_s else None)
    step = float(slices["slice_start_s"].diff().iloc[1]) if len(slices) > 1 else float(slice_s or 0)
    if isinstance(window, str):
        s.intro = f"No steady-state window: {window}."
    else:
        t0, t1 = window
        steady = window_figures(frame, t0, t1)
        s.intro = (f"Steady state from {t0:.3g} s to {t1:.3g} s (requests in flight at 0.9 of their "
                   f"median or more; {steady['requests']} requests sent in it).")  # fmt: skip
        whole = {k: summary.get(k) for k in COMPARED}
        table = pd.DataFrame({"whole run": whole, "steady state": {k: steady.get(k) for k in COMPARED}})
        s.tables.append(html_table(table, index=True))
    s.figures.append(_in_flight_figure(frame, None if isinstance(window, str) else window))
    s.notes.append(f"Time slices of {step:g} s (run.time_slice_s), by send time for latencies and "
                   "by arrival for tokens and completions.")  # fmt: skip
    s.tables.append(html_table(slices[[c for c in SLICE_COLUMNS if c in slices]]))
    return s


def _in_flight_figure(frame: pd.DataFrame, window: tuple[float, float] | None):
    fig, (ax,) = new_figure()
    times, c = in_flight(frame["start_s"].to_numpy(dtype=np.float64),
                         frame["end_s"].fillna(frame["start_s"]).to_numpy(dtype=np.float64))  # fmt: skip
    ax.step(times, c, where="post", label="requests in flight")
    if window is not None:
        ax.axvspan(*window, color="tab:green", alpha=0.15, label="steady state")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("in flight")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return render(
        fig, "Requests in flight", "The steady-state window (shaded) lies between ramp-up and drain."
    )
