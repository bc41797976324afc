"""Roofline step-time arithmetic on hand-computed cases (tiny model, tiny hardware)."""

from __future__ import annotations

import pytest

from engine.model.arch import ModelArch
from engine.sim.hardware import HardwareProfile
from engine.sim.model_counts import ParamCounts
from engine.sim.roofline import RooflineStepModel
from engine.sim.step_batch import StepBatch

# hidden 8, 2 layers, 4 heads of dim 2, 2 KV heads, MLP 16, vocab 32.
TINY = ModelArch(
    hidden_size=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, intermediate_size=16, vocab_size=32
)
# 8 experts, top-2.
TINY_MOE = ModelArch(8, 2, 4, 2, 2, 16, 32, num_experts=8, num_experts_per_tok=2)
# 1000 FLOP/s achievable (2000 * 0.5), 100 B/s achievable (200 * 0.5), 50 B/s interconnect.
HW = HardwareProfile(
    name="toy",
    peak_tflops={"fp16": 2000e-12, "fp32": 1000e-12},
    mem_bandwidth_gbs=200e-9,
    memory_gb=1e-6,
    interconnect_bw_gbs=100e-9,
    num_devices=2,
    gemm_efficiency=0.5,
    mem_efficiency=0.5,
    comm_efficiency=0.5,
    allreduce_latency_s=0.25,
    step_overhead_s=0.125,
)


def test_tiny_param_counts() -> None:
    # q 8*8, k and v 8*4 each, o 8*8 -> 192; MLP 3*8*16 = 384; embedding 256; norms 2*8 per layer + 8.
    counts = ParamCounts.of(TINY)
    assert (counts.attn, counts.mlp, counts.router) == (192, 384, 0)
    assert counts.layer(TINY.num_experts) == 576
    assert counts.total == 2 * (576 + 16) + 256 + 256 + 8
    moe = ParamCounts.of(TINY_MOE)
    assert moe.router == 64
    assert moe.layer(TINY_MOE.num_experts) == 192 + 8 * 384 + 64


def test_dense_step_every_term() -> None:
    model = RooflineStepModel(TINY, HW, tp=1, dtype="fp16")
    # A 3-token prefill chunk after 2 cached tokens (samples), and one decode at ctx 5.
    batch = StepBatch.from_requests([(3, 2, True, False), (1, 5, True, True)])
    assert (batch.num_tokens, batch.num_sampled, batch.attn_pairs, batch.kv_tokens_read) == (4, 2, 18, 7)
    parts = model.parts(batch)
    # linear: 2 * 4 tokens * 2 layers * 576 = 9216 FLOPs; bytes 2 * 576 * 2 = 2304.
    assert parts["linear"] == (9216, 2304, max(9216 / 1000, 2304 / 100))
    # attention: 4 * 2 layers * 4 heads * 2 dim * 18 pairs = 1152 FLOPs;
    # KV: 2 * 2 layers * 2 heads * 2 dim * 2 B = 32 B per token, (7 read + 4 written) tokens.
    assert parts["attention"] == (1152, 352, max(1152 / 1000, 352 / 100))
    # lm_head: 2 * 2 rows * 8 * 32 = 1024 FLOPs; weights 256 * 2 B.
    assert parts["lm_head"] == (1024, 512, 5.12)
    assert parts["allreduce"].seconds == 0.0
    assert parts["overhead"].seconds == 0.125
    total = 23.04 + 3.52 + 5.12 + 0.125
    assert model.step_time(batch) == pytest.approx(total)
    assert sum(model.breakdown(batch).values()) == pytest.approx(total)


def test_compute_bound_prefill_uses_flops() -> None:
    model = RooflineStepModel(TINY, HW, dtype="fp16")
    batch = StepBatch.from_requests([(100, 0, True, False)])
    linear = model.linear(batch)
    assert linear.flops == 2 * 100 * 2 * 576
    assert linear.seconds == pytest.approx(linear.flops / 1000)  # 230.4 s > 23.04 s of bytes
    # causal half: 100 * 101 / 2 pairs.
    assert model.attention(batch).flops == 4 * 2 * 4 * 2 * 5050


def test_tensor_parallel_splits_work_and_adds_allreduce() -> None:
    model = RooflineStepModel(TINY, HW, tp=2, dtype="fp16")
    batch = StepBatch.from_requests([(1, 5, True, True)] * 4)
    parts = model.parts(batch)
    assert parts["linear"].flops == 2 * 4 * 2 * 576 / 2
    assert parts["attention"].flops == 4 * 2 * 2 * 2 * batch.attn_pairs  # 2 heads per rank
    assert model.kv_heads_rank == 1
    assert parts["lm_head"].flops == 2 * 4 * 8 * 32 / 2
    # 4 all-reduces (2 layers x 2); each moves 2*(1/2) * 4 tokens * 8 * 2 B = 64 B at 50 B/s + 0.25 s.
    assert parts["allreduce"] == (0.0, 256, pytest.approx(4 * (64 / 50 + 0.25)))


def test_moe_counts_active_and_touched_experts() -> None:
    model = RooflineStepModel(TINY_MOE, HW, dtype="fp16")
    one = model.linear(StepBatch.from_requests([(1, 0, True, False)]))
    # FLOPs per token per layer: attn 192 + top-2 experts 768 + router 64.
    assert one.flops == 2 * 1 * 2 * (192 + 2 * 384 + 64)
    # one token touches 2 experts.
    assert one.bytes == 2 * (192 + 2 * 384 + 64) * 2
    many = model.linear(StepBatch.from_requests([(10, 0, True, False)]))
    assert many.bytes == 2 * (192 + 8 * 384 + 64) * 2  # min(8, 10 * 2) experts


def test_sampling_only_where_due_and_empty_batch() -> None:
    model = RooflineStepModel(TINY, HW, dtype="fp16")
    partial = StepBatch.from_requests([(3, 0, False, False)])
    assert model.lm_head(partial) == (0, 0, 0)
    assert model.step_time(StepBatch()) == 0.0
    assert model.breakdown(StepBatch()) == {}


def test_fp8_weights_keep_bf16_activations() -> None:
    hw = HardwareProfile("toy8", {"fp8": 1e-9, "bf16": 1e-9}, 1e-7, 1.0, 1e-7, 2)
    model = RooflineStepModel(TINY, hw, tp=2, dtype="fp8", kv_dtype="bf16")
    assert model.act_bytes == 2
    assert model.linear(StepBatch.from_requests([(1, 0, True, False)])).bytes == 2 * 576 / 2 * 1


def test_invalid_configurations() -> None:
    with pytest.raises(ValueError, match="divide"):
        RooflineStepModel(TINY, HW, tp=3)
    with pytest.raises(ValueError, match="exceeds"):
        RooflineStepModel(TINY, HW, tp=4)
    with pytest.raises(ValueError, match="no bf16"):
        RooflineStepModel(TINY, HW, dtype="bfloat16")


@pytest.mark.parametrize(("arch", "tp"), [(TINY, 1), (TINY, 2), (TINY_MOE, 1), (TINY_MOE, 2)])
def test_fast_step_time_equals_the_sum_of_parts(arch: ModelArch, tp: int) -> None:
    model = RooflineStepModel(arch, HW, tp=tp, dtype="fp16")
    batches = [
        StepBatch.from_requests([(1, 9, True, True)]),
        StepBatch.from_requests([(3, 0, False, False), (1, 4, True, True), (50, 20, True, False)]),
        StepBatch.from_requests([(2, 1, False, False)]),
    ]
    for batch in batches:
        assert model.step_time(batch) == pytest.approx(sum(p.seconds for p in model.parts(batch).values()))
