"""SimulatedExecutor: runner bookkeeping on hand-built plans, the virtual clock, the real engine loop."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.model.arch import ModelArch
from engine.sampling_params import SamplingParams
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from engine.sim.hardware import HardwareProfile
from engine.sim.step_batch import StepBatch
from engine.step_io import CachedRequestData, NewRequestData, SchedulerOutput

ARCH = ModelArch(8, 2, 4, 2, 2, 16, vocab_size=64, eos_token_id=8, max_position_embeddings=256)


class RecordingModel:
    """A step model that charges 1 ms per token and remembers each batch it priced."""

    def __init__(self) -> None:
        self.batches: list[StepBatch] = []

    def step_time(self, batch: StepBatch) -> float:
        self.batches.append(batch)
        return 1e-3 * batch.num_tokens

    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        return {"tokens": 1e-3 * batch.num_tokens}


def _new(rid: str, prompt: int, outputs: int = 0, computed: int = 0) -> NewRequestData:
    tokens = list(range(prompt + outputs))
    return NewRequestData(rid, tokens[:prompt], tokens, SamplingParams(), [], computed)


def _plan(
    new: list[NewRequestData], cached: dict[str, int], sched: dict[str, int], finished: set[str] | None = None
) -> SchedulerOutput:
    c = CachedRequestData(req_ids=list(cached), num_computed_tokens=list(cached.values()))
    return SchedulerOutput(new, c, sched, sum(sched.values()), finished or set())


def _executor(**kwargs: object) -> tuple[SimulatedExecutor, RecordingModel]:
    model = RecordingModel()
    cfg = EngineConfig()
    cfg.cache.num_blocks = 64
    return SimulatedExecutor(cfg, model, ARCH, **kwargs), model  # type: ignore[arg-type]


def _sampled(out) -> dict[str, list[int]]:
    return dict(zip(out.req_ids, out.sampled_token_ids, strict=True))


def test_chunked_prefill_samples_only_when_the_prompt_is_consumed() -> None:
    ex, model = _executor(start_time=100.0)
    assert ex.initialize() == 64 and ex.max_model_len == 256 and ex.eos_token_id == 8
    # Step 1: a (80 tokens) gets 50, b (4 tokens) all of them.
    out = ex.execute_model(_plan([_new("a", 80), _new("b", 4)], {}, {"a": 50, "b": 4}))
    assert _sampled(out) == {"a": [], "b": [1000 % 64]}
    assert ex.clock() == pytest.approx(100.054) and out.forward_time == pytest.approx(0.054)
    b1 = model.batches[-1]
    assert (b1.num_sampled, b1.num_prefill_tokens, b1.num_decode_reqs, b1.kv_tokens_read) == (1, 54, 0, 0)
    # Step 2: a gets its remaining 30 (samples), b decodes its sampled token.
    out = ex.execute_model(_plan([], {"a": 50, "b": 4}, {"a": 30, "b": 1}))
    assert _sampled(out) == {"a": [40], "b": [40]}
    b2 = model.batches[-1]
    assert (b2.num_prefill_tokens, b2.num_decode_tokens, b2.num_decode_reqs, b2.kv_tokens_read) == (
        30,
        1,
        1,
        54,
    )
    assert b2.attn_pairs == 30 * 50 + 30 * 31 // 2 + 4 + 1
    # Step 3: both decode.
    out = ex.execute_model(_plan([], {"a": 80, "b": 5}, {"a": 1, "b": 1}))
    assert _sampled(out) == {"a": [40], "b": [40]}
    assert model.batches[-1].num_decode_reqs == 2
    assert ex.num_steps == 3 and ex.busy_time == pytest.approx(0.054 + 0.031 + 0.002)


def test_finished_requests_are_forgotten_and_resumed_ones_recompute() -> None:
    ex, _ = _executor()
    ex.execute_model(_plan([_new("a", 3)], {}, {"a": 3}))  # a samples: knows 4 tokens
    ex.execute_model(_plan([], {"a": 3}, {"a": 1}, finished={"x"}))  # unknown finished id: ignored
    with pytest.raises(KeyError, match="unknown"):
        ex.execute_model(_plan([], {"a": 4}, {"a": 1}, finished={"a"}))
    # Preempted after 2 outputs: back as new with prompt + outputs, recomputed in two chunks.
    ex.execute_model(_plan([_new("a", 3, outputs=2)], {}, {"a": 4}))
    out = ex.execute_model(_plan([], {"a": 4}, {"a": 1}))
    assert _sampled(out) == {"a": [40]}


def test_token_id_avoids_eos_and_prefix_hits_count_as_context() -> None:
    ex, model = _executor(token_id=8)
    out = ex.execute_model(_plan([_new("a", 20, computed=16)], {}, {"a": 4}))
    assert _sampled(out) == {"a": [9]}
    assert model.batches[-1].kv_tokens_read == 16


def test_breakdown_totals_and_advance_to() -> None:
    ex, _ = _executor(record_breakdown=True)
    ex.execute_model(_plan([_new("a", 10)], {}, {"a": 10}))
    assert ex.time_by_part == {"tokens": pytest.approx(0.01)}
    ex.advance_to(5.0)
    ex.advance_to(1.0)  # never backwards
    assert ex.clock() == 5.0


def test_kv_blocks_from_hardware_when_config_leaves_them_open() -> None:
    cfg = EngineConfig()
    hw = HardwareProfile("toy", {"fp16": 1.0}, 1.0, memory_gb=1e-5, interconnect_bw_gbs=1.0, num_devices=2)
    ex = SimulatedExecutor(cfg, RecordingModel(), ARCH, hardware=hw, tp=2, dtype="fp16")
    cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs = 1, 1
    # 9000 B usable - 2216 params * 2 B / 2 ranks - activations (1 token * 80 B + 1 seq * 32 logits * 4 B)
    # = 6576 B; a block is 16 tokens * (2 * 2 layers * 1 head * 2 dim * 2 B) = 256 B -> 25 blocks.
    assert ARCH.num_parameters() == 2216
    assert ex.initialize() == 25
    with pytest.raises(ValueError, match="hardware profile"):
        SimulatedExecutor(EngineConfig(), RecordingModel(), ARCH).initialize()


def test_real_scheduler_runs_requests_to_max_tokens() -> None:
    from engine.core.sched.scheduler import Scheduler
    from engine.request import Request

    cfg = EngineConfig()
    cfg.cache.num_blocks = 40  # 640 tokens for 12 requests: some wait, some may be preempted
    cfg.scheduler.max_num_batched_tokens = 64
    model = CalibratedStepModel(0.002, {"num_prefill_tokens": 1e-4, "num_decode_reqs": 5e-4})
    ex = SimulatedExecutor(cfg, model, ARCH, start_time=10.0)
    sched = Scheduler(cfg.scheduler, cfg.cache, ex.initialize(), ex.max_model_len, clock=ex.clock)
    want = {}
    for i in range(12):
        prompt, max_tokens = 20 + 7 * i, 5 + 3 * i
        want[f"r{i}"] = max_tokens
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(f"r{i}", list(range(prompt)), params, 8, 10.0, max_tokens=max_tokens))
    got: dict[str, int] = {}
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        for o in sched.update_from_output(plan, ex.execute_model(plan)):
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    assert got == want
    assert ex.clock() == pytest.approx(10.0 + ex.busy_time)
    assert ex.num_steps > 12
