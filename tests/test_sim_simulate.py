"""workloads.simulate: the discrete-event loop on virtual time, hand-checked timelines."""

from __future__ import annotations

import time

import pytest

from engine.config import EngineConfig
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from workloads.metrics import summarize
from workloads.simulate import WallClock, simulate, trace_token_specs
from workloads.spec import RequestSpec
from workloads.traces import TraceRow

ARCH = ModelArch(8, 2, 4, 2, 2, 16, vocab_size=64, eos_token_id=8, max_position_embeddings=256)


def _setup(
    step_s: float = 0.01, budget: int = 64, num_blocks: int = 64
) -> tuple[EngineConfig, SimulatedExecutor]:
    cfg = EngineConfig()
    cfg.cache.num_blocks = num_blocks
    cfg.scheduler.max_num_batched_tokens = budget
    # A constant 10 ms per step (intercept only): every timeline below is hand-computable.
    return cfg, SimulatedExecutor(cfg, CalibratedStepModel(step_s, {}), ARCH)


def _spec(rid: str, arrival: float, prompt: int, out: int) -> RequestSpec:
    return RequestSpec(rid, arrival, None, [10 + i % 40 for i in range(prompt)], prompt, out)


def test_one_request_timeline() -> None:
    cfg, ex = _setup()
    res = simulate([_spec("a", 0.0, 10, 3)], cfg, ex)
    (rec,) = res.records
    # step 1 prefills 10 tokens and samples; steps 2 and 3 decode: tokens at 10, 20, 30 ms.
    assert rec.token_times == pytest.approx([0.01, 0.02, 0.03])
    assert rec.ttft_s == pytest.approx(0.01) and rec.tpot_s == pytest.approx(0.01)
    assert rec.output_tokens == 3 and rec.prompt_tokens == 10 and rec.finish_reason == "length"
    assert len(res.steps) == 3 and res.sim_s == pytest.approx(0.03)
    assert [s.num_prefill_tokens for s in res.steps] == [10, 0, 0]
    assert res.summary()["completed"] == 1


def test_idle_engine_jumps_to_the_next_arrival_and_chunks_prefill() -> None:
    cfg, ex = _setup(budget=16)
    res = simulate([_spec("a", 0.0, 40, 2), _spec("b", 100.0, 4, 2)], cfg, ex)
    a, b = res.records
    # a: 40 tokens in chunks of 16, 16, 8 (samples on the third), one decode.
    assert a.token_times == pytest.approx([0.03, 0.04])
    # b arrives at 100 s on an idle engine: the clock jumps there, no steps in between.
    assert b.start_s == pytest.approx(100.0) and b.token_times == pytest.approx([100.01, 100.02])
    assert len(res.steps) == 6 and res.sim_s == pytest.approx(100.02)
    assert ex.busy_time == pytest.approx(0.06)


def test_arrival_during_a_step_joins_at_the_next_step() -> None:
    cfg, ex = _setup()
    res = simulate([_spec("a", 0.0, 8, 4), _spec("b", 0.015, 8, 1)], cfg, ex)
    a, b = res.records
    # b arrives at 15 ms, mid-step 2 (10..20 ms): it is added at 20 ms and prefilled in step 3.
    assert b.scheduled_s == pytest.approx(0.015) and b.start_s == pytest.approx(0.02)
    assert b.token_times == pytest.approx([0.03]) and b.client_queue_s == pytest.approx(0.005)
    assert a.token_times == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert res.steps[2].num_prefill_tokens == 8 and res.steps[2].num_decode_tokens == 1


def test_preemption_under_a_small_cache_still_completes_everything() -> None:
    cfg, ex = _setup(num_blocks=6)  # 96 slots for 4 requests of 30 + 20 tokens
    specs = [_spec(f"r{i}", 0.0, 30, 20) for i in range(4)]
    res = simulate(specs, cfg, ex)
    summ = summarize(res.records, steps=res.steps_frame())
    assert summ["completed"] == 4 and summ["num_preemptions"] > 0
    assert all(r.output_tokens == 20 for r in res.records)


def test_trace_token_specs() -> None:
    rows = [TraceRow(0.5, 12, 3), TraceRow(1.5, 0, 0)]
    specs = trace_token_specs(rows, vocab_size=50, seed=1)
    assert [s.request_id for s in specs] == ["trace-0", "trace-1"]
    assert [s.arrival_s for s in specs] == [0.5, 1.5]
    assert [len(s.prompt_token_ids or []) for s in specs] == [12, 1]  # at least one prompt token
    assert [s.max_tokens for s in specs] == [3, 1]
    assert all(0 <= t < 50 for s in specs for t in s.prompt_token_ids or [])
    assert trace_token_specs(rows, 50, seed=1)[0].prompt_token_ids == specs[0].prompt_token_ids


def test_max_duration_records_the_unfinished_as_interrupted() -> None:
    cfg, ex = _setup()
    res = simulate([_spec("a", 0.0, 8, 50), _spec("b", 10.0, 8, 2)], cfg, ex, max_duration_s=0.095)
    assert res.stop_reason == "max_duration"
    (a,) = res.records  # b was never sent
    assert a.error and a.finish_reason == "abort" and len(a.token_times) == 10


def test_wall_clock_waits() -> None:
    clock = WallClock()
    t = clock.clock()
    clock.advance_to(t + 0.02)
    assert clock.clock() >= t + 0.02
    clock.advance_to(t)  # the past: no wait
    assert time.time() - t < 1.0
