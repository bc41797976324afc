"""vLLM's keys carry vLLM's definitions (issue 35 item 3, METRICS.md).

- `summarize` against a restatement of what `vllm bench serve` computes from the same streams
  (its client: TTFT at the first chunk, one ITL per later chunk, latency to the last chunk,
  TPOT = (latency - TTFT) / (usage completion tokens - 1); `calculate_metrics`: pooled ITLs,
  unweighted TPOTs, numpy statistics, chunks per 1-second bin, a sweep for peak concurrency),
  with streams whose chunks carry several tokens and whose engine timestamps differ from the
  client's clock: the vLLM-named keys must follow the client, not the engine;
- the engine and per-token figures sit under keys of their own and survive requests.csv;
- the in-process target streams one chunk per engine step;
- `definitions` names the definition behind each family of keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from analysis.metrics import summarize
from analysis.record import TargetResult
from analysis.runfolder import read_requests, records_from_frame, write_requests
from workloads.record_builder import record_from_result
from workloads.spec import RequestSpec
from workloads.targets.engine import _step_chunks

T0 = 1000.0  # the run's start on the perf_counter clock


def _stream(i: int, rng: np.random.Generator) -> tuple[float, TargetResult]:
    """Request i: sent at `start`, chunks of 1-5 tokens with uneven gaps; the engine's own token
    times are evenly spaced at 7 ms (so any key taken from the engine differs from the client's)."""
    start = T0 + 0.05 * i
    counts = [int(k) for k in rng.integers(1, 6, size=int(rng.integers(1, 9)))]
    gaps = rng.uniform(0.005, 0.06, size=len(counts))
    times = list(start + 0.02 + np.cumsum(gaps))
    n = sum(counts)
    res = TargetResult(chunk_times=times, chunk_tokens=counts, prompt_tokens=30 + i, output_tokens=n,
                       finish_reason="length", done_time=times[-1] + 0.003,
                       engine_token_offsets=[0.007 * j for j in range(n)], server_ttft_s=0.01,
                       server_e2el_s=0.01 + 0.007 * (n - 1))
    return start, res


def _vllm_view(start: float, res: TargetResult) -> dict:
    """What vLLM's client records for one stream (RequestFuncOutput's fields)."""
    c = res.chunk_times
    return {"start_time": start, "ttft": c[0] - start, "itl": list(np.diff(c)),
            "latency": c[-1] - start, "output_tokens": res.output_tokens, "prompt_len": res.prompt_tokens}


def _vllm_metrics(outs: list[dict], dur_s: float) -> dict[str, float]:
    """vLLM's calculate_metrics over successful outputs (percentiles 50, 90, 99)."""
    ttfts = [o["ttft"] for o in outs]
    e2els = [o["latency"] for o in outs]
    itls = [g for o in outs for g in o["itl"]]
    tpots = [(o["latency"] - o["ttft"]) / (o["output_tokens"] - 1) for o in outs if o["output_tokens"] > 1]
    out: dict[str, float] = {}
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(vals) * 1000.0
        out |= {f"mean_{name}_ms": arr.mean(), f"median_{name}_ms": np.median(arr), f"std_{name}_ms": arr.std()}
        out |= {f"p{p}_{name}_ms": np.percentile(arr, p) for p in (50, 90, 99)}
    n_out = sum(o["output_tokens"] for o in outs)
    out |= {"request_throughput": len(outs) / dur_s, "output_throughput": n_out / dur_s,
            "total_token_throughput": (sum(o["prompt_len"] for o in outs) + n_out) / dur_s}
    t_min = min(o["start_time"] for o in outs)
    bins: dict[int, int] = {}
    for o in outs:  # one entry per chunk: start + ttft + cumulative itl
        t = o["start_time"] + o["ttft"]
        for g in [0.0, *o["itl"]]:
            t += g
            bins[int(t - t_min)] = bins.get(int(t - t_min), 0) + 1
    out["max_output_tokens_per_s"] = max(bins.values())
    events = sorted([(o["start_time"], 1) for o in outs] + [(o["start_time"] + o["latency"], -1) for o in outs])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    out["max_concurrent_requests"] = peak
    return out


def _records(n: int = 12, seed: int = 3):
    rng = np.random.default_rng(seed)
    recs, views = [], []
    for i in range(n):
        start, res = _stream(i, rng)
        spec = RequestSpec(f"r{i}", start - T0, None, [1] * (30 + i), 30 + i, res.output_tokens or 1)
        recs.append(record_from_result(spec, res, t0=T0, scheduled_s=start - T0, start_s=start - T0,
                                       lateness_s=0.0, now_s=0.0))
        views.append(_vllm_view(start, res))
    return recs, views


def test_vllm_named_keys_match_vllms_computation_from_the_same_streams() -> None:
    recs, views = _records()
    assert all(r.timing_source == "engine" for r in recs)  # engine times present, and not used below
    s = summarize(recs)
    want = _vllm_metrics(views, s["duration"])
    for key, value in want.items():
        assert s[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    assert s["total_output_tokens"] == sum(v["output_tokens"] for v in views)
    assert s["sources"]["itl"] == "client" and s["sources"]["engine_itl/tpot/e2el"] == "engine"


def test_engine_and_per_token_figures_have_keys_of_their_own() -> None:
    recs, _ = _records()
    s = summarize(recs)
    assert s["engine_median_itl_ms"] == pytest.approx(7.0) and s["engine_mean_tpot_ms"] == pytest.approx(7.0)
    e2el = [r.ttft_s + 0.007 * (r.output_tokens - 1) for r in recs]
    assert s["engine_mean_e2el_ms"] == pytest.approx(np.mean(e2el) * 1000.0)
    # per token: each chunk's gap over its tokens; the gaps of a request sum to E2EL - TTFT
    per_token = [g for r in recs for g in r.itls_per_token_s]
    assert len(per_token) == sum(r.output_tokens - 1 for r in recs)
    assert s["mean_itl_per_token_ms"] == pytest.approx(np.mean(per_token) * 1000.0)
    for r in recs:
        assert sum(r.itls_per_token_s) == pytest.approx(r.e2el_s - r.ttft_s)
    # chunks of several tokens: the per-chunk ITL is larger than the per-token one
    assert s["median_itl_ms"] > 1.5 * s["median_itl_per_token_ms"]


def test_requests_csv_keeps_every_family(tmp_path) -> None:
    recs, _ = _records()
    write_requests(tmp_path, recs)
    again = summarize(records_from_frame(read_requests(tmp_path)))
    first = summarize(recs)
    families = [k for k in first if k.endswith("_ms") and ("itl" in k or "tpot" in k or "e2el" in k)]
    assert any(k.startswith("engine_") for k in families) and any("per_token" in k for k in families)
    for key in families:
        assert again[key] == pytest.approx(first[key], rel=1e-6), key


def test_mixed_engine_timing_gives_no_engine_figures() -> None:
    recs, _ = _records()
    recs[0].timing_source = "chunks"  # one request without the extension
    s = summarize(recs)
    assert not any(k.startswith("engine_") for k in s) and s["sources"]["engine_itl/tpot/e2el"] == "mixed"


def test_in_process_chunks_are_engine_steps() -> None:
    # a speculative step makes 3 tokens at once: one chunk of 3, as a server would stream it
    assert _step_chunks([1.0, 1.01, 1.01, 1.01, 1.02], 5.0) == [(6.0, 1), (6.01, 3), (6.02, 1)]


def test_definitions_name_each_family() -> None:
    recs, _ = _records()
    d = summarize(recs)["definitions"]
    for name in ("ttft", "tpot", "itl", "e2el", "max_output_tokens_per_s", "max_concurrent_requests"):
        assert "vLLM" in d[name], name
    assert "per chunk" in d["itl"] and "client" in d["itl"]
    assert "spread" in d["itl_per_token"] and "engine" in d["engine_itl"]
    assert "itl_chunk" not in d


def test_report_summary_has_lines_of_their_own_with_definitions(tmp_path) -> None:
    from reports.run_data import RunData
    from reports.sections_requests import summary_table

    recs, _ = _records()
    html = summary_table(RunData(path=tmp_path, summary=summarize(recs))).tables[0]
    for key in ("median_itl_ms", "median_itl_per_token_ms", "engine_median_itl_ms", "engine_median_tpot_ms",
                "engine_median_e2el_ms"):
        assert key in html, key
    assert "spread evenly" in html and "engine steps" in html and "per chunk" in html
