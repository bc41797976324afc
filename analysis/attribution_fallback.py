"""SLO attribution without step members: a request's windows against the run's steps.

Used for requests that no recorded step names (HTTP targets, whose engine does not report its
batches; run folders older than step_members.csv). Nothing says which steps were the request's
own, so its windows are placed on the client's token times (first token, last token) and the
steps inside them are taken as its steps; the engine's durations (server timing) size the TTFT
parts. See analysis/attribution.py for the member-based figures and the cause rules.

TTFT: `queueing` (engine queue time), `prefill_interference` (its prefill window times the
share of the window's tokens that were not its prompt), `prefill` (the rest), `front_end` (client
TTFT minus engine queue and prefill), `harness_lateness` (driver lateness + client queue: the
only harness evidence without engine times).
Decode window: `prefill_interference` (steps with prefill tokens: time above the decode-only line
of the same batch, a + c * decode requests, fitted to the run's decode-only steps), `batch_size`
(what the line adds above a batch of one), `preemption` (steps beyond its output tokens when the
window saw a preemption, at the mean step time), `front_end` (client decode window minus the
engine's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.record import RequestRecord


@dataclass(frozen=True)
class DecodeLine:
    """Decode-only step time (s) against the number of decoding requests: a + c * n."""

    a: float
    c: float

    def at(self, n: float) -> float:
        return self.a + self.c * max(n, 1.0)


def fit_decode_line(steps: pd.DataFrame | None) -> DecodeLine | None:
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
