"""The servelab timing extension over HTTP (engine/entrypoints/timing.py, issue 16 item 1).

- a stream whose chunks carry 4 tokens each, with the extension: vLLM's ITL stays the per-chunk
  gap the client saw, the engine's per-token gaps are kept under `engine_*`, the front-end share
  is client TTFT minus engine TTFT (no server needed);
- without the extension: the chunk figures, the per-token spread, no engine figures;
- a real servelab-serve sending 4 tokens per SSE chunk (`server.stream_chunk_tokens=4`): the
  engine ITL the workbench keeps matches the engine's own ITL figure from the same run
  (its Prometheus `inter_token_latency` histogram sum / count) within 5%, vLLM's per-chunk ITL
  is about 4 times larger, and the engine's first-to-last token span matches what the client
  saw (clock alignment). Same run, same engine: robust on a busy machine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from analysis.metrics import summarize
from workloads.record_builder import record_from_result
from workloads.spec import RequestSpec
from workloads.targets.openai import _Stream

SPEC = RequestSpec("r0", 0.0, None, [1, 2, 3], 3, 8)


def _chunk(text: str, cum: int) -> dict:
    return {"choices": [{"text": text, "finish_reason": None}], "usage": {"prompt_tokens": 3, "completion_tokens": cum}}


def _feed_coalesced(with_extension: bool) -> _Stream:
    # engine makes a token every 10 ms from t=100.05; the server sends them 4 at a time
    engine = [100.05 + 0.01 * i for i in range(8)]
    s = _Stream(chat=False, on_token=None)
    s.feed(_chunk("a", 1), 10.060)  # first token alone, 10 ms after the engine made it
    s.feed(_chunk("bcde", 5), 10.100)
    s.feed(_chunk("fgh", 8), 10.130)
    if with_extension:
        s.feed({"choices": [], "servelab": {"clock": "unix", "timing": [{
            "index": 0, "arrival": 100.0, "scheduled": 100.01, "first_token": 100.05, "finished": 100.12,
            "token_times": engine,
            "phases_s": {"queue": 0.01, "prefill": 0.04, "decode": 0.07, "preempted": None}}]}}, 10.131)
    return s


def test_engine_timing_gives_per_token_itl_and_front_end_share() -> None:
    res = _feed_coalesced(with_extension=True).finish()
    rec = record_from_result(SPEC, res, t0=10.0, scheduled_s=0.0, start_s=0.0, lateness_s=0.0, now_s=0.2)
    assert rec.timing_source == "engine"
    assert rec.itls_s == pytest.approx([0.04, 0.03])  # vLLM's: per chunk, client clock
    assert rec.engine_itls_s == pytest.approx([0.01] * 7)
    assert rec.itls_per_token_s == pytest.approx([0.01] * 7)  # 40 ms over 4 tokens, 30 ms over 3
    assert rec.chunk_itls_s == pytest.approx([0.04, 0.03])
    assert rec.e2el_s == pytest.approx(0.130) and rec.engine_e2el_s == pytest.approx(0.130)
    assert rec.ttft_s == pytest.approx(0.060)  # the client's
    assert rec.server_ttft_s == pytest.approx(0.05)
    assert rec.front_end_s == pytest.approx(0.010)
    assert (rec.server_queued_s, rec.server_prefill_s, rec.server_decode_s) == pytest.approx((0.01, 0.04, 0.07))
    summary = summarize([rec])
    assert summary["mean_itl_ms"] == pytest.approx(35.0)
    assert summary["engine_mean_itl_ms"] == pytest.approx(10.0) and summary["engine_mean_tpot_ms"] == pytest.approx(10.0)
    assert summary["mean_itl_per_token_ms"] == pytest.approx(10.0)
    assert summary["sources"]["itl"] == "client" and summary["sources"]["engine_itl/tpot/e2el"] == "engine"
    assert summary["mean_front_end_ms"] == pytest.approx(10.0)


def test_without_extension_chunk_timing_stays_and_is_named() -> None:
    res = _feed_coalesced(with_extension=False).finish()
    rec = record_from_result(SPEC, res, t0=10.0, scheduled_s=0.0, start_s=0.0, lateness_s=0.0, now_s=0.2)
    assert rec.timing_source == "chunks" and rec.front_end_s is None
    assert rec.itls_s == pytest.approx([0.04, 0.03])
    assert rec.itls_per_token_s == pytest.approx([0.01] * 4 + [0.01] * 3)  # 40 ms over 4, 30 ms over 3
    summary = summarize([rec])
    assert summary["mean_itl_ms"] == pytest.approx(35.0) and summary["mean_itl_per_token_ms"] == pytest.approx(10.0)
    assert summary["sources"]["engine_itl/tpot/e2el"] is None and "engine_mean_itl_ms" not in summary


def _prom_mean(text: str, name: str) -> float:
    vals = {}
    for line in text.splitlines():
        if line.startswith(name + "_sum") or line.startswith(name + "_count"):
            key = "sum" if "_sum" in line.split(" ")[0] else "count"
            vals[key] = vals.get(key, 0.0) + float(line.rsplit(" ", 1)[-1])
    return vals["sum"] / vals["count"]


@pytest.mark.slow
def test_server_with_4_token_chunks_matches_engine_itl(tmp_path: Path) -> None:
    import aiohttp

    from conf.schema import RunConfig, compose_typed
    from workloads.driver import Driver
    from workloads.targets.build import write_serve_config
    from workloads.targets.engine import ServerTarget

    cfg = compose_typed(RunConfig, "run", ["model.load_format=dummy", "model.num_layers_override=2",
                                           "run.time_reference=false"])
    config = write_serve_config(cfg.engine_config(shape_dir=tmp_path / "shapes"), tmp_path,
                                {"stream_chunk_tokens": 4})
    target = ServerTarget(config, log_path=str(tmp_path / "server.log"))
    specs = [RequestSpec(f"r{i}", 0.0, None, list(range(10 + i, 26 + i)), 16, 25) for i in range(4)]

    async def go() -> tuple[list, str, list[dict]]:
        await target.start()
        try:
            result = await Driver(target, closed_loop=True, concurrency=2).run(specs)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{target.base_url}/metrics") as resp:
                    prom = await resp.text()
                plain = []  # non-streaming, with and without asking for the extension
                for headers in ({"X-Servelab-Timing": "1"}, {}):
                    body = {"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
                    async with session.post(f"{target.base_url}/v1/completions", json=body, headers=headers) as resp:
                        plain.append(await resp.json())
            return result.records, prom, plain
        finally:
            await target.stop()

    try:
        records, prom, plain = asyncio.run(go())
    finally:
        target.shutdown()
    asked, not_asked = plain
    timing = asked["servelab"]["timing"][0]
    assert len(timing["token_times"]) == asked["usage"]["completion_tokens"] == 5
    assert timing["arrival"] <= timing["scheduled"] <= timing["first_token"] <= timing["finished"]
    assert "servelab" not in not_asked
    assert all(r.ok and r.output_tokens == 25 for r in records), [r.error for r in records]
    assert all(r.timing_source == "engine" for r in records)
    chunks = [len(r.chunk_itls_s or []) + 1 for r in records]
    assert max(chunks) <= 1 + 6 + 1  # first token alone, then 4 per chunk (the last may be short)
    summary = summarize(records)
    engine_itl_ms = _prom_mean(prom, "vllm:inter_token_latency_seconds") * 1000.0
    assert summary["engine_mean_itl_ms"] == pytest.approx(engine_itl_ms, rel=0.05)
    assert summary["mean_itl_ms"] > 2.5 * summary["engine_mean_itl_ms"]
    for r in records:  # engine first->last token span vs the client's first->last chunk
        client_span = sum(r.chunk_itls_s or [])
        engine_span = r.token_times[-1] - r.token_times[0]
        assert engine_span == pytest.approx(client_span, rel=0.05, abs=0.02)
    assert np.isfinite(summary["mean_front_end_ms"])
    assert summary["mean_server_queued_ms"] is not None
