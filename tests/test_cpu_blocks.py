"""engine/kernels/csrc/block_linear.cpp (engine/kernels/cpu_blocks.py): GGUF blocks multiplied as stored, on
AVX2 or by the scalar reference, against the float64 product of the dequantized weights (gguf's own
quantizer and dequantizer make the blocks and the reference), within the bound the kernel's note
derives: x rounded to 14 bits per 32-input block, the rest float32 sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import cpu_blocks
from engine.kernels.isa import cpu_flags

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

ops = cpu_blocks.block_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ toolchain built engine/kernels/csrc/block_linear.cpp")
KINDS = ("Q4_1", "Q8_0", "Q5_0")
AVX2 = {"avx2", "fma", "f16c"} <= cpu_flags()


def gguf_blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [n, k / 32, bytes] GGUF blocks of a random matrix, their float64 dequantization [n, k])."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = getattr(GGMLQuantizationType, kind)
    raw = quants.quantize(w, qtype)
    deq = torch.from_numpy(quants.dequantize(raw, qtype).reshape(n, k).astype(np.float64))
    return torch.from_numpy(raw.view(np.uint8).reshape(n, k // 32, -1).copy()), deq


def make_blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed columns block_linear reads, the float64 dequantization [n, k])."""
    raw, deq = gguf_blocks(kind, n, k, seed)
    return cpu_blocks.pack(raw, kind), deq


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: per output, sum_k |w_k| s_b / 2 (x's 14-bit rounding, s_b = max |x| of k's block / 16256)
    plus float32's rounding of the sums (2^-20 of sum |x_k w_k|, generous for K <= 2048)."""
    xd = x.double()
    m, k = xd.shape
    s = xd.abs().view(m, k // 32, 32).amax(-1) / 16256  # [M, KB]
    per_input = s.repeat_interleave(32, dim=1) / 2  # [M, K]
    return per_input @ w.abs().T + (xd.abs() @ w.abs().T) * 2.0**-20 + 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_blocks_match_the_dequantized_product(kind: str, rows: int) -> None:
    blocks, w = make_blocks(kind, 72, 320, seed=rows)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows)) * 3
    ref = x.double() @ w.T
    bound = error_bound(x, w)
    for scalar in (False, True):
        y = ops.block_linear(x, blocks, kind, scalar)  # type: ignore[union-attr]
        assert y.shape == (rows, 72) and y.dtype == torch.float32
        err = (y.double() - ref).abs()
        assert bool((err <= bound).all()), f"{kind} rows={rows} scalar={scalar}: worst {float((err / bound).max()):.2f}x the bound"
        # and not trivially: the bound is far below the outputs themselves
        assert float(bound.max()) < 0.01 * float(ref.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_vector_path_and_scalar_reference_sum_the_same_integers(kind: str) -> None:
    """Same integers, other order of the float32 sums: the two agree to float32 rounding."""
    blocks, w = make_blocks(kind, 40, 640, seed=7)
    x = torch.randn(4, 640, generator=torch.Generator().manual_seed(3))
    vec = ops.block_linear(x, blocks, kind, False)  # type: ignore[union-attr]
    ref = ops.block_linear(x, blocks, kind, True)  # type: ignore[union-attr]
    scale = x.abs() @ w.abs().float().T
    assert bool(((vec - ref).abs() <= scale * 2.0**-18).all())


def test_this_build_runs_the_instruction_set_this_cpu_has() -> None:
    """AVX2 + FMA + F16C (x86-64-v3) -> the AVX2 path; a CPU without them gets the scalar reference."""
    assert cpu_blocks.isa() == ("avx2" if AVX2 else "scalar")
    assert cpu_blocks.max_rows("Q4_1") == (cpu_blocks.MAX_ROWS["Q4_1"] if AVX2 else 1)
    assert cpu_blocks.max_rows("Q2_K") == 0  # not a kind this op reads


def test_bfloat16_rows_give_the_float32_result_rounded() -> None:
    blocks, _ = make_blocks("Q4_1", 64, 256)
    x = torch.randn(2, 256).bfloat16()
    y16 = ops.block_linear(x, blocks, "Q4_1")  # type: ignore[union-attr]
    y32 = ops.block_linear(x.float(), blocks, "Q4_1")  # type: ignore[union-attr]
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.bfloat16())


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_holding_nan_or_inf_gives_nan(kind: str) -> None:
    blocks, _ = make_blocks(kind, 8, 64)
    x = torch.randn(2, 64)
    x[0, 40] = float("nan")
    x[1, 3] = float("inf")
    y = ops.block_linear(x, blocks, kind)  # type: ignore[union-attr]
    assert bool(y.isnan().all())


def test_zero_rows_and_zero_blocks() -> None:
    blocks, w = make_blocks("Q8_0", 16, 64)
    assert ops.block_linear(torch.zeros(0, 64), blocks, "Q8_0").shape == (0, 16)  # type: ignore[union-attr]
    y = ops.block_linear(torch.zeros(3, 64), blocks, "Q8_0")  # type: ignore[union-attr]
    assert torch.equal(y, torch.zeros(3, 16))


def test_refuses_what_it_does_not_take() -> None:
    blocks, _ = make_blocks("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="Q4_1, Q8_0, Q5_0, Q4_K or Q6_K, got Q2_K"):
        ops.block_linear(torch.randn(1, 64), blocks, "Q2_K")  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"K \(48\) must be a multiple of 32 for Q4_1"):
        ops.block_linear(torch.randn(1, 48), blocks, "Q4_1")  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"packed columns uint8 \[N, 80\] \(block_pack of Q4_1 blocks of K = 96"):
        ops.block_linear(torch.randn(1, 96), blocks, "Q4_1")  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"block_pack: GGUF blocks uint8 \[N, K / 32, 34\]"):
        ops.block_pack(gguf_blocks("Q4_1", 8, 64)[0], "Q8_0")  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.block_linear(torch.randn(1, 64).double(), blocks, "Q4_1")  # type: ignore[union-attr]


def test_pack_lays_out_each_columns_quant_bytes_then_its_scales() -> None:
    """Q4_1, K = 320 (10 blocks): 10 x 16 quant bytes, then d and m, each padded to 16 fp16 values."""
    raw, _ = gguf_blocks("Q4_1", 3, 320)
    packed = cpu_blocks.pack(raw, "Q4_1")
    assert packed.shape == (3, 10 * 16 + 16 * 2 * 2)
    assert torch.equal(packed[:, :160].view(3, 10, 16), raw[:, :, 4:])
    assert torch.equal(packed[:, 160:180].view(3, 10, 2), raw[:, :, 0:2])  # d
    assert torch.equal(packed[:, 192:212].view(3, 10, 2), raw[:, :, 2:4])  # m
    assert int(packed[:, 180:192].sum()) == 0 and int(packed[:, 212:].sum()) == 0  # padding


def test_attach_reads_blocks_at_few_rows_and_the_dense_weight_above() -> None:
    blocks, w = gguf_blocks("Q4_1", 48, 128)
    layer = torch.nn.Linear(128, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w.float())
    assert cpu_blocks.attach(layer, "Q4_1", blocks)
    limit = cpu_blocks.max_rows("Q4_1")
    with torch.inference_mode():
        few = torch.randn(limit, 128)
        assert torch.equal(layer(few), ops.block_linear(few, cpu_blocks.pack(blocks, "Q4_1"), "Q4_1"))  # type: ignore[union-attr]
        many = torch.randn(limit + 1, 128)
        assert torch.equal(layer(many), torch.nn.functional.linear(many, layer.weight))
    cpu_blocks.detach(layer)
    assert "gguf_blocks" not in layer.__dict__ and "forward" not in layer.__dict__
    assert not cpu_blocks.attach(layer, "Q4_1", blocks[:, :2])  # blocks of another shape: refused
