"""SLO misses attributed to a cause, per request, against what the request costs alone.

For every completed request that misses a TTFT, TPOT or E2EL SLO, the time it took is split into
components, in ms, and the largest names the cause (`unknown` when none is above zero). The
request's own compute at no contention (`prefill` for TTFT, `decode` for TPOT, both for E2EL) is
the baseline: it competes only when it alone exceeds the SLO (the request would miss on an idle
engine); otherwise the cause is what the request paid above it.

From the request's own steps (step_members.csv: each step's requests and their tokens, recorded
by the engine; in-process, offline and simulated runs). Its first-token step is its first
non-decode step that reaches its prompt length; steps up to it are its TTFT part, the later ones
its decode part (TPOT; E2EL takes both).
- `queueing`: engine arrival -> first scheduled (the engine's queue time; TTFT only).
- `preemption`: the time it was out of the running batch after its first scheduling (from the
  end of its step before a resume to the start of the resuming step) plus the whole time of the
  steps that recomputed it (members of kind `recompute`).
- `prefill_interference`: in each of its other steps, step time x (other requests' prefill and
  recompute tokens / the step's scheduled tokens). Scheduled tokens exclude prefix hits, so a hit
  is nobody's work. Steps it sat out without a preemption (budget taken) count here when they ran
  prefill tokens, under `batch_size` otherwise.
- `prefill`: the rest of its prefill steps (its own prompt, chunked or not).
- `batch_size`: in each decode step of k requests, what a decode-only step of k takes above one of
  a single request (lower quartiles of the run's decode-only steps per batch size, as another
  process's load only adds time; a line fitted to them for sizes without one-request steps). Never the cause when the run's decode-only steps never
  varied in batch (under 10% of them off the common size: every request paid it alike, it is
  the load); 0 then, as there is no other size to measure it against.
- `decode`: the rest of its decode steps (its own token, and a busy machine's noise).
- `front_end`: client time minus engine time (TTFT: client TTFT - engine arrival -> first token;
  decode: client first -> last token minus the engine's): HTTP, tokenization, network.
- `harness_lateness` (TTFT and E2EL only: it cannot change TPOT): the part of the client-side
  TTFT gap the harness's own lag explains, min(front-end gap, driver lateness + client queue). A
  late send alone does not lengthen a TTFT measured from the send; a pinned driver also reads late.

Without step members for a request (HTTP targets; older run folders) its windows are placed on
the client's token times instead (analysis/attribution_fallback.py). Without engine timings
and steps, the cause is `unknown` unless the harness lagged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.attribution_fallback import DecodeLine, decode_components, fit_decode_line, ttft_components
from analysis.record import RequestRecord

__all__ = ["CAUSES", "METRICS", "Attribution", "DecodeLine", "RunSteps", "attribute", "attribution_frame",
           "fit_decode_line", "miss_summary", "own_components", "prepare_steps"]  # fmt: skip

CAUSES = ("queueing", "prefill_interference", "prefill", "decode", "preemption", "batch_size", "front_end",
          "harness_lateness", "unknown")  # fmt: skip
METRICS = ("ttft", "tpot", "e2el")
_PREFILL_KINDS = ("prefill", "recompute")
VARIED_SHARE = 0.1  # share of decode-only steps off the most common batch size for a varied batch


@dataclass
class Attribution:
    request_id: str
    missed: list[str]
    causes: dict[str, str]  # metric -> cause
    ttft_ms: dict[str, float] = field(default_factory=dict)  # component -> ms
    decode_ms: dict[str, float] = field(default_factory=dict)  # component -> ms over the decode window
    source: str = "members"  # "members" (its own steps) | "windows" (fallback)


@dataclass
class RunSteps:
    """A run's steps prepared for attribution: each request's own steps with their times and the
    step's token totals, the one-row decode baseline, and whether the decode batch ever varied."""

    own: dict[str, pd.DataFrame]
    prefill_by_step: pd.Series  # step -> prefill + recompute tokens scheduled
    batch_extra_s: dict[int, float]  # requests in a decode-only step -> its time above one request's
    batch_varied: bool

    def extra(self, rows: int) -> float:
        """What a decode step of `rows` requests takes above one of a single request (s)."""
        if rows <= 1 or not self.batch_extra_s:
            return 0.0
        if rows in self.batch_extra_s:
            return self.batch_extra_s[rows]
        return self.batch_extra_s.get(0, 0.0) * (rows - 1)  # key 0: the fitted per-request slope


def prepare_steps(steps: pd.DataFrame, members: pd.DataFrame) -> RunSteps:
    """Join members to their steps (start = time - step_time, end = time)."""
    m = members.copy()
    m["pf"] = np.where(m["kind"].isin(_PREFILL_KINDS), m["num_tokens"], 0)
    per = m.groupby("step").agg(total=("num_tokens", "sum"), prefill=("pf", "sum"), rows=("num_tokens", "size"))
    times = steps.set_index("step")[["time", "step_time"]]
    joined = m.join(per, on="step").join(times, on="step", how="inner")
    joined["start"] = joined["time"] - joined["step_time"]
    own = {rid: g.sort_values("step") for rid, g in joined.groupby("request_id", sort=False)}
    decode_only = per[per["prefill"] == 0].join(times, how="inner")
    sizes = decode_only["rows"].value_counts(normalize=True)
    # A varied batch: at least VARIED_SHARE of the decode-only steps away from the common size. A few
    # steps at the edges (requests starting or finishing a step apart) measure no baseline, only noise.
    varied = len(sizes) >= 2 and float(1.0 - sizes.iloc[0]) >= VARIED_SHARE
    extra: dict[int, float] = {}
    if varied:  # lower quartiles per batch size: a busy machine only adds time, in bursts
        medians = decode_only.groupby("rows")["step_time"].quantile(0.25)
        line = fit_decode_line(steps)
        slope = line.c if line is not None else 0.0
        one = float(medians.loc[1]) if 1 in medians.index else None
        for rows, t in medians.items():
            extra[int(rows)] = max(0.0, float(t) - one) if one is not None else slope * (int(rows) - 1)
        extra[0] = slope
    return RunSteps(own, per["prefill"], extra, bool(varied))


def _first_token_index(kinds: np.ndarray, reach: np.ndarray, prompt: int) -> int:
    """Its first-token step: the first non-decode step that reaches the prompt's length."""
    done = np.flatnonzero((kinds != "decode") & (reach >= prompt))
    if done.size:
        return int(done[0])
    decodes = np.flatnonzero(kinds == "decode")
    return max(int(decodes[0]) - 1, 0) if decodes.size else len(kinds) - 1


def own_components(r: RequestRecord, own: pd.DataFrame, run: RunSteps) -> tuple[dict[str, float], dict[str, float]]:
    """(TTFT components, decode-window components) in ms, from the request's own steps."""
    kinds = own["kind"].to_numpy(str)
    n, step = own["num_tokens"].to_numpy(float), own["step"].to_numpy(int)
    t, start, end = own["step_time"].to_numpy(float), own["start"].to_numpy(float), own["time"].to_numpy(float)
    total, prefill, rows = own["total"].to_numpy(float), own["prefill"].to_numpy(float), own["rows"].to_numpy(int)
    ft = _first_token_index(kinds, own["num_computed"].to_numpy(float) + n, r.prompt_tokens)
    ttft: Counter[str] = Counter()
    dec: Counter[str] = Counter()
    for i in range(len(own)):
        part = ttft if i <= ft else dec
        if i > 0:
            gap = max(0.0, start[i] - end[i - 1])
            if kinds[i] == "recompute" and kinds[i - 1] != "recompute":
                part["preemption"] += gap  # out of the running batch until this resume
            elif step[i] - step[i - 1] > 1:
                skipped = run.prefill_by_step.loc[step[i - 1] + 1 : step[i] - 1].sum()
                part["prefill_interference" if skipped > 0 else "batch_size"] += gap
        if kinds[i] == "recompute":
            part["preemption"] += t[i]
            continue
        others = prefill[i] - (n[i] if kinds[i] != "decode" else 0.0)
        interference = t[i] * others / total[i] if total[i] > 0 else 0.0
        part["prefill_interference"] += interference
        rest = t[i] - interference
        if kinds[i] == "decode":
            batch = min(rest, run.extra(int(rows[i])))
            part["decode"] += rest - batch
            part["batch_size"] += batch
        else:
            part["prefill"] += rest
    queued = r.server_queued_s
    if queued is not None:
        ttft["queueing"] += queued
    engine_ttft = r.server_ttft_s if r.server_ttft_s is not None else (queued or 0.0) + end[ft] - start[0]
    gap = max(0.0, (r.ttft_s or 0.0) - engine_ttft)
    ttft["harness_lateness"] = min(gap, r.lateness_s + r.client_queue_s)
    ttft["front_end"] = gap - ttft["harness_lateness"]
    if r.first_token_s is not None and r.end_s is not None:
        engine_decode = r.server_decode_s if r.server_decode_s is not None else end[-1] - end[ft]
        dec["front_end"] = max(0.0, (r.end_s - r.first_token_s) - engine_decode)
    return ({k: v * 1000.0 for k, v in ttft.items()}, {k: v * 1000.0 for k, v in dec.items()})


_OWN = {"ttft": ("prefill",), "tpot": ("decode",), "e2el": ("prefill", "decode")}


def _cause(metric: str, comps: dict[str, float], per: int, slo_ms: float, keep_out: tuple[str, ...]) -> str:
    """The largest component (`keep_out` aside; `unknown` when none is above 0), the request's own
    compute competing only when it alone exceeds the SLO. `per`: what the metric divides the
    components by (TPOT: output tokens - 1)."""
    own = sum(comps.get(k, 0.0) for k in _OWN[metric]) / per
    skip = keep_out if own >= slo_ms else (*keep_out, *_OWN[metric])
    rest = [(k, v) for k, v in comps.items() if k not in skip and v > 0]
    return max(rest, key=lambda kv: kv[1])[0] if rest else "unknown"


def missed_metrics(r: RequestRecord, slo: dict[str, float | None]) -> list[str]:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2el_s}
    return [m for m in METRICS if slo.get(f"{m}_ms") is not None and values[m] is not None
            and values[m] * 1000.0 > slo[f"{m}_ms"]]  # type: ignore[operator]  # fmt: skip


def attribute(
    records: Sequence[RequestRecord], steps: pd.DataFrame | None, slo: dict[str, float | None] | None,
    members: pd.DataFrame | None = None,
) -> list[Attribution]:
    """One Attribution per measured, completed request that misses a given SLO.

    `steps`: steps.csv's frame (engine steps; scraped /metrics rows carry no composition and are
    ignored); `members`: step_members.csv's (None: every request takes the fallback)."""
    if not slo or all(v is None for v in slo.values()):
        return []
    if steps is not None and ("time" not in steps or "step_time" not in steps):
        steps = None  # scraped /metrics rows: no per-step composition
    run = prepare_steps(steps, members) if steps is not None and members is not None and not members.empty else None
    line = fit_decode_line(steps) if steps is not None else None
    # batch_size competes only where the batch varied (with members: their decode-only steps).
    varied = run.batch_varied if run is not None else line is not None and line.c > 0
    keep_out = () if varied else ("batch_size",)
    out = []
    for r in records:
        if r.is_warmup or not r.ok:
            continue
        missed = missed_metrics(r, slo)
        if not missed:
            continue
        own = run.own.get(r.request_id) if run is not None else None
        if own is not None and not own.empty:
            ttft, decode = own_components(r, own, run)  # type: ignore[arg-type]
            source = "members"
        else:
            ttft, decode = ttft_components(r, steps), decode_components(r, steps, line)
            source = "windows"
        merged = Counter(ttft)
        merged.update(decode)
        parts = {"ttft": (ttft, 1), "tpot": (decode, max(r.output_tokens - 1, 1)), "e2el": (dict(merged), 1)}
        causes = {m: _cause(m, *parts[m], slo[f"{m}_ms"], keep_out) for m in missed}  # type: ignore[arg-type]
        out.append(Attribution(r.request_id, missed, causes, ttft, decode, source))
    return out


def miss_summary(attributions: Sequence[Attribution]) -> dict[str, Any]:
    """summary.json keys: `slo_misses` (per metric) and `slo_miss_causes` (per metric, per cause)."""
    causes: dict[str, Counter[str]] = {m: Counter() for m in METRICS}
    for a in attributions:
        for m, c in a.causes.items():
            causes[m][c] += 1
    return {
        "slo_misses": {m: sum(causes[m].values()) for m in METRICS},
        "slo_miss_causes": {m: dict(causes[m].most_common()) for m in METRICS if causes[m]},
    }


def attribution_frame(attributions: Sequence[Attribution]) -> pd.DataFrame:
    """One row per missing request: the missed metrics, each metric's cause, every component."""
    rows = []
    for a in attributions:
        row: dict[str, Any] = {"request_id": a.request_id, "missed": ",".join(a.missed), "source": a.source}
        row |= {f"cause_{m}": a.causes.get(m, "") for m in METRICS}
        row |= {f"ttft_{k}_ms": v for k, v in a.ttft_ms.items()}
        row |= {f"decode_{k}_ms": v for k, v in a.decode_ms.items()}
        rows.append(row)
    return pd.DataFrame(rows)
