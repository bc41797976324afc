"""The SLO-miss section: why requests missed, and the worst ones drawn against the batch.

Recomputed from requests.csv, steps.csv and step_members.csv (analysis/attribution.py), so a
report rebuilt from an old run folder gets it too. Each component, as the page's note says:
queueing (engine arrival -> first scheduled), preemption (out of the batch after its first
scheduling + the steps that recomputed it), prefill_interference (its steps' time x other
requests' prefill tokens / the step's tokens; prefix hits are nobody's), prefill / decode (its own
compute; decode up to a one-row decode step), batch_size (decode time above a one-row step; never
the cause when the batch never varied), front_end (client minus engine time), harness_lateness
(TTFT and E2EL only). Without step_members.csv (HTTP targets) the request's client-time windows
are laid on the steps instead.
"""

from __future__ import annotations

import pandas as pd

from analysis.attribution import CAUSES, attribute, attribution_frame, miss_summary
from analysis.runfolder import read_requests, records_from_frame
from analysis.step_members import read_members
from reports.page import Section, html_table, new_figure, render
from reports.run_data import RunData

WORST = 6
_COLORS = {"queued": "#9e9e9e", "prefill": "#ff7f0e", "decode": "#1f77b4"}


def slo_misses(run: RunData) -> Section:
    s = Section("slo-misses", "SLO misses by cause",
                intro="Each request missing a TTFT, TPOT or E2EL SLO, with the component that cost it most, "
                      "measured on the request's own engine steps against its cost alone: queueing (arrival -> "
                      "first scheduled), preemption (time out of the batch + its recompute), prefill_interference "
                      "(its steps' share of other requests' prefill tokens), prefill / decode (its own compute at "
                      "one row), batch_size (decode above one row; not a cause when the batch never varied), "
                      "front_end (client minus engine), harness_lateness (TTFT and E2EL only). See "
                      "analysis/attribution.py.")  # fmt: skip
    slo = run.slo()
    if not slo:
        s.missing = "No SLO set for this run (slo.ttft_ms / slo.tpot_ms / slo.e2el_ms)."
        return s
    if run.requests is None or run.requests.empty:
        s.missing = f"No requests: requests.csv is {run.problems.get('requests.csv', 'empty')}."
        return s
    steps = run.steps if run.steps is not None and "step_time" in run.steps else None
    frame = read_requests(run.path)  # text columns as '' (not NaN)
    records = records_from_frame(frame[frame["ttft_ms"].notna()])  # failed requests never miss an SLO
    members = read_members(run.path) if steps is not None else None
    found = attribute(records, steps, dict(slo), members)
    if not found:
        s.notes.append("Every completed request met the SLOs.")
        return s
    summary = miss_summary(found)
    table = pd.DataFrame(
        [{"metric": m, "misses": summary["slo_misses"][m], **summary["slo_miss_causes"].get(m, {})}
         for m in ("ttft", "tpot", "e2el") if f"{m}_ms" in slo]  # fmt: skip
    ).fillna(0)
    cols = ["metric", "misses", *[c for c in CAUSES if c in table]]
    s.tables.append(html_table(table[cols]))
    if steps is None:
        s.notes.append("No per-step engine records (an HTTP target without engine stats): causes inside the "
                       "engine cannot be told apart.")  # fmt: skip
    elif members is None:
        s.notes.append("No step_members.csv (an HTTP target, or an older run): each request's client-time "
                       "windows were laid on the run's steps, which cannot tell its own steps from others'.")  # fmt: skip
    frame = attribution_frame(found)
    worst = _worst(run.requests, frame)
    if steps is not None and not worst.empty:
        s.figures.append(_timelines(worst, steps))
    return s


def _worst(requests: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    rows = requests.merge(frame, on="request_id")
    rows = rows.assign(_e2e=rows["e2el_ms"].astype(float)).sort_values("_e2e", ascending=False)
    return rows.head(WORST)


def _timelines(worst: pd.DataFrame, steps: pd.DataFrame):  # noqa: ANN202 - a report Figure
    fig, (ax_req, ax_batch) = new_figure(8, 4.2, ncols=2)
    for i, (_, r) in enumerate(worst.iterrows()):
        first, end = float(r["first_token_s"]), float(r["end_s"])
        prefill = (r.get("server_prefill_ms") or 0.0) / 1000.0
        queued = (r.get("server_queued_ms") or 0.0) / 1000.0
        t_sched = first - prefill
        spans = [("queued", t_sched - queued, queued), ("prefill", t_sched, prefill), ("decode", first, end - first)]
        for name, start, width in spans:
            if width > 0:
                ax_req.barh(i, width, left=start, color=_COLORS[name], label=name if i == 0 else None)
        causes = ",".join(sorted({c for c in (r.get("cause_ttft"), r.get("cause_tpot"), r.get("cause_e2el"))
                                  if isinstance(c, str) and c}))  # fmt: skip
        ax_req.text(end, i, f" {causes}", va="center", fontsize=7)
    ax_req.set_yticks(range(len(worst)), [str(x)[:12] for x in worst["request_id"]], fontsize=7)
    ax_req.set_xlabel("time (s)")
    ax_req.legend(fontsize=7, loc="lower right")
    lo = float((worst["first_token_s"] - worst["ttft_ms"] / 1000.0).min())
    hi = float(worst["end_s"].max())
    w = steps[(steps["time"] >= lo) & (steps["time"] <= hi)]
    t = w["time"].astype(float)
    ax_batch.fill_between(t, 0, w["num_decode_tokens"], step="post", alpha=0.7, label="decode tokens")
    ax_batch.fill_between(t, w["num_decode_tokens"], w["num_decode_tokens"] + w["num_prefill_tokens"],
                          step="post", alpha=0.7, label="prefill tokens")  # fmt: skip
    ax_batch.set_xlim(lo, hi)
    ax_req.set_xlim(lo, hi)
    ax_batch.set_xlabel("time (s)")
    ax_batch.set_ylabel("tokens per step")
    ax_batch.legend(fontsize=7)
    return render(fig, "Worst misses against the batch",
                  f"The {len(worst)} slowest missing requests (queued / prefill / decode, cause at the right) "
                  "beside the tokens each engine step ran over the same interval.")  # fmt: skip
