"""The external-KV section: what the KV connector moved (engine/kv_transfer/, docs/kv_transfer.md).

Reads summary.json (`kv_connector` totals of an engine in the harness's process,
`kv_connector_instances` per server of a `target=pd` run), steps.csv's `kv_*` columns and
requests.csv's `kv_*` columns; each part is shown when its file has it.
"""

from __future__ import annotations

import pandas as pd

from reports.page import Section, html_table, new_figure, render
from reports.run_data import RunData

_INSTANCE_COLUMNS = ["instance", "role", "loaded_blocks", "saved_blocks", "loaded_bytes", "saved_bytes",
                     "load_seconds", "save_seconds", "external_hit_tokens", "load_failures"]  # fmt: skip
_REQUEST_COLUMNS = ["kv_external_tokens", "kv_bytes_loaded", "kv_bytes_saved", "kv_load_wait_ms", "kv_save_ms"]


def kv_connector(run: RunData) -> Section:
    s = Section("kv-connector", "External KV (connector)",
                intro="KV blocks loaded from and saved to the external store; with target=pd, the prefill "
                      "instances (producers) and decode instances (consumers) side by side.")  # fmt: skip
    sm = run.summary or {}
    instances = sm.get("kv_connector_instances")
    if instances:
        df = pd.DataFrame(instances)
        s.tables.append(html_table(df[[c for c in _INSTANCE_COLUMNS if c in df]]))
    totals = sm.get("kv_connector")
    if totals:
        s.tables.append(html_table(pd.DataFrame(list(totals.items()), columns=["metric", "total"])))
    req = run.measured_requests()
    if req is not None and set(_REQUEST_COLUMNS) <= set(req) and req["kv_bytes_loaded"].notna().any():
        desc = req[_REQUEST_COLUMNS].astype(float).describe(percentiles=[0.5, 0.9, 0.99]).T
        s.tables.append(html_table(desc[["mean", "50%", "90%", "99%", "max"]], index=True))
    steps = run.steps
    if steps is not None and {"time", "kv_blocks_loaded", "kv_blocks_saved"} <= set(steps) and (
        steps["kv_blocks_loaded"].sum() + steps["kv_blocks_saved"].sum() > 0
    ):
        t = steps["time"].astype(float)
        fig, (ax,) = new_figure(7, 2.6)
        ax.step(t, steps["kv_blocks_loaded"].cumsum(), where="post", label="loaded")
        ax.step(t, steps["kv_blocks_saved"].cumsum(), where="post", label="saved")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV blocks (cumulative)")
        ax.legend(loc="upper left")
        s.figures.append(render(fig, "Connector loads and saves", "KV blocks loaded and saved so far, per step."))
    if not s.tables and not s.figures:
        s.missing = "No external KV in this run (kv_transfer.kv_connector is null, or nothing was moved)."
    return s
