"""servelab-trace analyze / synthesize (workloads/trace_tools.py, workloads/trace_cli.py).

The engine check replays a slice of the Mooncake trace through the engine's own scheduler and
KV cache on the simulated executor (as tests/test_trace_prefix_reuse.py does), one request
after another with a cache that evicts nothing, and compares its prefix-cache hit rate with
the analysis's: they must agree to the token.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from workloads.simulate import simulate, trace_token_specs
from workloads.trace_cli import main as trace_main
from workloads.trace_tools import analyze_trace, prefix_hit_rate, session_ids, synthesize_trace
from workloads.traces import TraceRow, fit_to_context, load_trace, slice_rows

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
MOONCAKE = TRACES / "synthetic_trace.jsonl"
AZURE_CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
needs_mooncake = pytest.mark.skipif(
    not MOONCAKE.exists(), reason="needs ../shared/traces/synthetic_trace.jsonl"
)
needs_azure = pytest.mark.skipif(
    not AZURE_CONV.exists() or not AZURE_CODE.exists(),
    reason="needs ../shared/traces/AzureLLMInferenceTrace_{conv,code}.csv",
)


def test_prefix_hit_rate_by_hand() -> None:
    # trace block 8, KV block 4: a = ids [1, 2] (16 tokens), b = [1, 3] (16), c = [1, 2] (13).
    rows = [TraceRow(0, 16, 1, [1, 2]), TraceRow(1, 16, 1, [1, 3]), TraceRow(2, 13, 1, [1, 2])]
    # b hits block 1's two KV blocks (8); c hits 3 of its 3 full blocks (cap (13-1)//4 = 3): 12.
    assert prefix_hit_rate(rows, 4, 8) == pytest.approx((8 + 12) / 45)
    # a second copy of a asks for 16 tokens but the last one is computed: 3 blocks hit, not 4.
    assert prefix_hit_rate(rows[:1] * 2, 4, 8) == pytest.approx(12 / 32)
    # ids are chained: id 2 after a different first block is a different block.
    assert prefix_hit_rate([TraceRow(0, 16, 1, [1, 2]), TraceRow(1, 16, 1, [5, 2])], 4, 8) == 0.0
    with pytest.raises(ValueError, match="multiple"):
        prefix_hit_rate(rows, 3, 8)


def test_sessions_follow_prefixes_or_groups() -> None:
    rows = [TraceRow(0, 20, 1, [1, 2, 3]), TraceRow(1, 20, 1, [9, 8]),
            TraceRow(2, 40, 1, [1, 2, 4, 5, 6]), TraceRow(3, 60, 1, [1, 2, 4, 5, 7, 8])]  # fmt: skip
    # row 2 starts with row 0's blocks but its last; row 3 with row 2's: one session of 3 turns.
    assert session_ids(rows) == [0, 1, 0, 0]
    grouped = [TraceRow(0, 1, 1, group="x"), TraceRow(1, 1, 1, group="y"), TraceRow(2, 1, 1, group="x")]
    assert session_ids(grouped) == [0, 1, 0]


def test_gamma_shape_tells_poisson_from_bursty() -> None:
    rng = np.random.default_rng(0)
    poisson = np.cumsum(rng.exponential(0.5, 4000))
    bursty = np.cumsum(rng.gamma(0.25, 2.0, 4000))
    shape = lambda ts: analyze_trace([TraceRow(float(t), 10, 5) for t in ts])["arrivals"]["gamma_shape"]  # noqa: E731
    assert shape(poisson) == pytest.approx(1.0, abs=0.06)
    assert shape(bursty) == pytest.approx(0.25, abs=0.03)


@needs_azure
@needs_mooncake
def test_analyze_azure_and_mooncake_match_the_traces_readme(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    assert trace_main(["analyze", str(MOONCAKE), "--block-size", "128", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["rows"] == 3993 and m["prompt_tokens"]["p50"] == pytest.approx(11.6e3, rel=0.01)
    assert m["arrivals"]["rate"] == pytest.approx(3.91, abs=0.01)
    assert m["arrivals"]["gamma_shape"] == pytest.approx(1.0, abs=0.05)  # Poisson arrivals
    assert m["prefix_cache"]["hit_rate_at_trace_block"] == pytest.approx(0.65, abs=0.005)
    assert m["sessions"]["turns_max"] > 1 and m["sessions"]["sessions"] < 3993  # multi-turn order kept

    conv, _ = load_trace(AZURE_CONV)
    code, _ = load_trace(AZURE_CODE)
    a, c = analyze_trace(conv), analyze_trace(code)
    assert a["arrivals"]["rate"] == pytest.approx(5.53, abs=0.01) and a["prompt_tokens"]["p50"] == 1020
    assert c["arrivals"]["interarrival_cv"] == pytest.approx(13.2, abs=0.1)
    assert c["arrivals"]["gamma_shape"] < 0.5 < a["arrivals"]["gamma_shape"]  # code is the bursty one
    assert "prefix_cache" not in a and a["sessions"]["sessions"] == len(conv)


@needs_mooncake
@pytest.mark.parametrize("kv_block", [16, 64])
def test_analysis_hit_rate_equals_the_engines_on_a_mooncake_slice(kv_block: int) -> None:
    rows, info = load_trace(MOONCAKE)
    rows = slice_rows(rows, first_n=300, info=info)
    # lengths / 8: the 512-token hash blocks become 64-token blocks (a multiple of both KV blocks).
    rows = fit_to_context(rows, 32768, "scale", scale=1 / 8, info=info)
    rows = [replace(r, output_tokens=2) for r in rows]  # outputs do not change prompt hits
    assert info.block_size == 64
    expected = prefix_hit_rate(rows, kv_block, info.block_size)
    assert expected > 0.02

    cfg = EngineConfig()
    cfg.cache.block_size, cfg.cache.num_blocks = (
        kv_block,
        2 + sum(r.prompt_tokens + 2 for r in rows) // kv_block,
    )
    cfg.scheduler.max_num_batched_tokens = 4096
    arch = ModelArch(64, 2, 4, 2, 16, 128, vocab_size=32000, eos_token_id=1, max_position_embeddings=32768)
    executor = SimulatedExecutor(cfg, CalibratedStepModel(0.01, {}), arch)
    specs = trace_token_specs(rows, vocab_size=32000, block_size=info.block_size)
    res = simulate(specs, cfg, executor, closed_loop=True, concurrency=1)  # one after another
    summary = res.summary()
    assert summary["completed"] == 300 and summary["num_preemptions"] == 0
    assert summary["prefix_cache_hit_rate"] == pytest.approx(expected, abs=1e-9)


@needs_mooncake
def test_synthesized_mooncake_keeps_its_statistics(tmp_path: Path) -> None:
    rows, _ = load_trace(MOONCAKE)
    src = analyze_trace(rows, block_size=128)
    out = tmp_path / "synth.jsonl"
    assert trace_main(["synthesize", str(MOONCAKE), "--num-requests", str(len(rows)), "--rate-scale", "2",
                       "--out", str(out)]) == 0  # fmt: skip
    synth_rows, info = load_trace(out)
    assert info.format == "jsonl" and len(synth_rows) == len(rows)
    syn = analyze_trace(synth_rows, block_size=128)
    for key in ("prompt_tokens", "output_tokens"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert syn[key][stat] == pytest.approx(src[key][stat], rel=0.05), (key, stat)
    assert syn["arrivals"]["rate"] == pytest.approx(2 * src["arrivals"]["rate"], rel=0.05)
    assert syn["arrivals"]["gamma_shape"] == pytest.approx(src["arrivals"]["gamma_shape"], rel=0.05)
    assert syn["prefix_cache"]["hit_rate"] == pytest.approx(src["prefix_cache"]["hit_rate"], rel=0.05)
    assert syn["sessions"]["sessions"] == pytest.approx(src["sessions"]["sessions"], rel=0.05)
    # it is a new trace: new gaps, and the blocks no other row shares have new ids.
    assert [r.timestamp_s for r in synth_rows[:5]] != [r.timestamp_s / 2 for r in rows[:5]]
    assert synth_rows[0].hash_ids != rows[0].hash_ids


@needs_azure
def test_synthesized_azure_subset_and_copies_keep_lengths_and_burstiness() -> None:
    rows, _ = load_trace(AZURE_CODE)
    src = analyze_trace(rows)
    for n in (4000, 2 * len(rows) + 100):
        syn = analyze_trace(synthesize_trace(rows, n, rate_scale=0.5, seed=1))
        assert syn["rows"] == n
        for key in ("prompt_tokens", "output_tokens"):
            assert syn[key]["mean"] == pytest.approx(src[key]["mean"], rel=0.05), (n, key)
            assert syn[key]["p50"] == pytest.approx(src[key]["p50"], rel=0.05), (n, key)
        assert syn["arrivals"]["rate"] == pytest.approx(0.5 * src["arrivals"]["rate"], rel=0.05)
        assert syn["arrivals"]["gamma_shape"] == pytest.approx(src["arrivals"]["gamma_shape"], rel=0.05)


def test_synthesize_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        synthesize_trace([TraceRow(0, 1, 1)], 0)
    with pytest.raises(ValueError):
        synthesize_trace([TraceRow(0, 1, 1)], 5, rate_scale=0)


def test_burstgpt_whole_second_arrivals_leave_zero_gaps_out_of_the_fit(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rng = np.random.default_rng(3)
    t = np.floor(np.cumsum(rng.exponential(2.0, 400)))  # whole seconds: some requests share one
    lines += [
        f"{int(x)},ChatGPT,{100 + i % 50},{0 if i % 40 == 0 else 20},0,Conversation log"
        for i, x in enumerate(t)
    ]
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "a.json"
    assert trace_main(["analyze", str(path), "--out", str(out), "--window-s", "100"]) == 0
    a = json.loads(out.read_text())
    assert a["rows"] == 390  # failed requests (0 response tokens) dropped by the loader
    assert a["arrivals"]["zero_gaps"] > 0 and np.isfinite(a["arrivals"]["gamma_shape"])
    assert a["output_tokens"]["min"] == 20 and "prefix_cache" not in a
    assert len(a["arrivals"]["rate_per_window"]) == int(a["arrivals"]["span_s"] // 100) + 1
