"""workloads.simulate: the discrete-event loop on virtual time, hand-checked timelines."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from analysis.metrics import summarize
from engine.config import EngineConfig
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
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


def test_closed_loop_users_send_the_next_spec_when_theirs_finished() -> None:
    cfg, ex = _setup()
    specs = [_spec("a", 0.0, 4, 2), _spec("b", 0.0, 4, 3), _spec("c", 5.0, 4, 2)]
    res = simulate(specs, cfg, ex, closed_loop=True, concurrency=2)
    a, b, c = sorted(res.records, key=lambda r: r.request_id)
    # a and b start at 0 (c's arrival time is ignored); a finishes at 20 ms, so its user sends c then.
    assert a.start_s == b.start_s == 0.0 and a.token_times == pytest.approx([0.01, 0.02])
    assert c.scheduled_s == pytest.approx(0.02) and c.start_s == pytest.approx(0.02)
    assert c.token_times == pytest.approx([0.03, 0.04]) and b.token_times == pytest.approx([0.01, 0.02, 0.03])
    with pytest.raises(ValueError, match="closed loop needs concurrency"):
        simulate(specs, *_setup(), closed_loop=True)


def _next_turn(spec: RequestSpec, record) -> RequestSpec | None:  # type: ignore[no-untyped-def]
    if spec.turn >= 1:
        return None
    ids = [*(spec.prompt_token_ids or []), *(record.output_token_ids or []), 11]
    return replace(spec, request_id=f"{spec.session_id}-t1", arrival_s=record.done_s + 0.5,
                   prompt_token_ids=ids, prompt_len=len(ids), turn=1)  # fmt: skip


def test_a_closed_loop_user_finishes_its_session_before_the_next_spec() -> None:
    cfg, ex = _setup()
    first = replace(_spec("s-t0", 0.0, 4, 2), session_id="s", follow_up=_next_turn)
    res = simulate([first, _spec("x", 0.0, 4, 1)], cfg, ex, closed_loop=True, concurrency=1)
    t0, t1, x = res.records
    assert (t0.request_id, t1.request_id, x.request_id) == ("s-t0", "s-t1", "x")
    # The follow-up is sent at its own time (finish + 0.5 s think time), by the same user;
    # the next spec of the workload only once the session ended.
    assert t1.scheduled_s == pytest.approx(0.52) and t1.prompt_tokens == 4 + 2 + 1 and t1.turn == 1
    assert x.start_s == pytest.approx(t1.done_s)


def test_open_loop_concurrency_slots_and_follow_ups() -> None:
    cfg, ex = _setup()
    first = replace(_spec("s-t0", 0.0, 4, 2), session_id="s", follow_up=_next_turn)
    res = simulate([first, _spec("x", 0.0, 4, 1)], cfg, ex, concurrency=1)
    t0, x, t1 = res.records
    # x waits for the slot (client queue, not lateness); the follow-up comes at its own time.
    assert x.scheduled_s == 0.0 and x.start_s == pytest.approx(t0.done_s) and x.client_queue_s > 0
    assert t1.request_id == "s-t1" and t1.scheduled_s == pytest.approx(t0.done_s + 0.5)


def test_wall_clock_waits() -> None:
    clock = WallClock()
    t = clock.clock()
    clock.advance_to(t + 0.02)
    assert clock.clock() >= t + 0.02
    clock.advance_to(t)  # the past: no wait
    assert time.time() - t < 1.0
