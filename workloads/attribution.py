"""SLO misses attributed to a cause: each missing request joined to the engine's steps.

For every completed request that misses a TTFT, TPOT or E2EL SLO, the time it lost is split
into components, in ms, and the largest names the cause:

TTFT (request start -> first token):
- `queueing`: arrival -> first scheduled (engine timestamps): waited for a batch slot or KV;
- `prefill_interference`: the part of its prefill window (first scheduled -> first token)
  spent on other requests' tokens: the window's duration times the share of the tokens
  scheduled in its steps that were not its own prompt;
- `prefill`: the rest of that window (its own prompt's compute, chunked or not);
- `front_end`: TTFT minus the engine's queue and prefill time (HTTP, tokenization,
  detokenization, network).
TPOT (first token -> last token, per output token) and the decode part of E2EL:
- `prefill_interference`: in steps that also ran prefill tokens, the step time above what a
  decode-only step of the same batch takes (a line fitted to the run's decode-only steps:
  step_time = a + c * decode requests);
- `batch_size`: in every step, what the decode-only line adds above a batch of one;
- `preemption`: steps in its decode window beyond its output tokens (it sat out while
  preempted and recomputed), when the window saw a preemption, times the mean step time;
- `front_end`: client decode window minus the engine's decode time.
Every miss also has `harness_lateness` (driver lateness + client-side queue): it wins only
when the harness, not the server, is the problem. Without engine timings (a server that
does not report them) and without steps, the cause is `unknown`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from workloads.record import RequestRecord

CAUSES = ("queueing", "prefill_interference", "prefill", "preemption", "batch_size", "front_end",
          "harness_lateness", "unknown")  # fmt: skip
METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class DecodeLine:
    """Decode-only step time (s) against the number of decoding requests: a + c * n."""

    a: float
    c: float

    def at(self, n: float) -> float:
        return self.a + self.c * max(n, 1.0)


def fit_decode_line(steps: pd.DataFrame) -> DecodeLine | None:
    """Least squares over decode-only steps; a flat line when their batch never varies."""
    need = {"num_prefill_tokens", "num_decode_reqs", "step_time"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return None
    d = steps[(steps["num_prefill_tokens"] == 0) & (steps["num_decode_reqs"] > 0)]
    if d.empty:
        return DecodeLine(float(steps["step_time"].median()), 0.0)
    n, t = d["num_decode_reqs"].to_numpy(float), d["step_time"].to_numpy(float)
    if len(d) >= 3 and np.unique(n).size >= 2:
        c, a = np.polyfit(n, t, 1)
        if c >= 0:
            return DecodeLine(float(a), float(c))
    return DecodeLine(float(np.median(t)), 0.0)


@dataclass
class Attribution:
    request_id: str
    missed: list[str]
    causes: dict[str, str]  # metric -> cause
    ttft_ms: dict[str, float] = field(default_factory=dict)  # component -> ms
    decode_ms: dict[str, float] = field(default_factory=dict)  # component -> ms over the decode window


def _window(steps: pd.DataFrame, start: float, end: float) -> pd.DataFrame:
    t = steps["time"]
    return steps[(t > start) & (t <= end + 1e-9)]


def ttft_components(r: RequestRecord, steps: pd.DataFrame | None) -> dict[str, float]:
    ttft = (r.ttft_s or 0.0) * 1000.0
    comps = {"harness_lateness": (r.lateness_s + r.client_queue_s) * 1000.0}
    if r.server_queued_s is None or r.server_prefill_s is None:
        return comps
    queued, prefill = r.server_queued_s * 1000.0, r.server_prefill_s * 1000.0
    comps["queueing"] = queued
    share = 0.0
    if steps is not None and not steps.empty and r.first_token_s is not None:
        w = _window(steps, r.first_token_s - prefill / 1000.0, r.first_token_s)
        total = float((w["num_prefill_tokens"] + w["num_decode_tokens"]).sum()) if not w.empty else 0.0
        if total > 0:
            share = max(0.0, 1.0 - r.prompt_tokens / total)
    comps["prefill_interference"] = prefill * share
    comps["prefill"] = prefill * (1.0 - share)
    comps["front_end"] = max(0.0, ttft - queued - prefill)
    return comps


def decode_components(r: RequestRecord, steps: pd.DataFrame | None, line: DecodeLine | None) -> dict[str, float]:
    """Components over the whole decode window, in ms (divide by output_tokens - 1 for TPOT)."""
    comps: dict[str, float] = {}
    if r.first_token_s is None or r.end_s is None:
        return comps
    client_ms = (r.end_s - r.first_token_s) * 1000.0
    if r.server_decode_s is not None:
        comps["front_end"] = max(0.0, client_ms - r.server_decode_s * 1000.0)
    if steps is None or steps.empty or line is None:
        return comps
    w = _window(steps, r.first_token_s, r.end_s)
    if w.empty:
        return comps
    n = w["num_decode_reqs"].to_numpy(float)
    t = w["step_time"].to_numpy(float)
    pred = line.a + line.c * np.maximum(n, 1.0)
    has_prefill = w["num_prefill_tokens"].to_numpy() > 0
    comps["prefill_interference"] = float(np.clip(t - pred, 0.0, None)[has_prefill].sum()) * 1000.0
    comps["batch_size"] = float(np.clip(pred - line.at(1.0), 0.0, None).sum()) * 1000.0
    extra = len(w) - max(r.output_tokens - 1, 0)
    if extra > 0 and "num_preemptions" in w and int(w["num_preemptions"].sum()) > 0:
        comps["preemption"] = extra * float(t.mean()) * 1000.0
    return comps


def _dominant(comps: dict[str, float]) -> str:
    best = max(comps.items(), key=lambda kv: kv[1], default=("unknown", 0.0))
    return best[0] if best[1] > 0 else "unknown"


def missed_metrics(r: RequestRecord, slo: dict[str, float | None]) -> list[str]:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2el_s}
    return [m for m in METRICS if slo.get(f"{m}_ms") is not None and values[m] is not None
            and values[m] * 1000.0 > slo[f"{m}_ms"]]  # type: ignore[operator]  # fmt: skip


def attribute(
    records: Sequence[RequestRecord], steps: pd.DataFrame | None, slo: dict[str, float | None] | None
) -> list[Attribution]:
    """One Attribution per measured, completed request that misses a given SLO."""
    if not slo or all(v is None for v in slo.values()):
        return []
    if steps is not None and ("time" not in steps or "step_time" not in steps):
        steps = None  # scraped /metrics rows: no per-step composition
    line = fit_decode_line(steps) if steps is not None else None
    out = []
    for r in records:
        if r.is_warmup or not r.ok:
            continue
        missed = missed_metrics(r, slo)
        if not missed:
            continue
        ttft = ttft_components(r, steps)
        decode = decode_components(r, steps, line)
        causes = {}
        for m in missed:
            if m == "ttft":
                causes[m] = _dominant(ttft)
            elif m == "tpot":
                causes[m] = _dominant({**decode, "harness_lateness": ttft["harness_lateness"]})
            else:
                merged = Counter(ttft)
                merged.update(decode)
                causes[m] = _dominant(dict(merged))
        out.append(Attribution(r.request_id, missed, causes, ttft, decode))
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
        row: dict[str, Any] = {"request_id": a.request_id, "missed": ",".join(a.missed)}
        row |= {f"cause_{m}": a.causes.get(m, "") for m in METRICS}
        row |= {f"ttft_{k}_ms": v for k, v in a.ttft_ms.items()}
        row |= {f"decode_{k}_ms": v for k, v in a.decode_ms.items()}
        rows.append(row)
    return pd.DataFrame(rows)
