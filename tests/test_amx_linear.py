"""The decode-sized linear kernels (engine/kernels/amx_linear.py) against references, on CPUs with AMX
or AVX512-BF16 (whichever this CPU has: the same tests cover both paths)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amx_linear
from engine.kernels.cpu_kernels import kernels
from engine.kernels.cpu_linear import pack_weight, packed_linear, prepack_supported

pytestmark = pytest.mark.skipif(
    not amx_linear.available(), reason="neither AMX (amx_bf16) nor AVX512-BF16 on this CPU, or kernels.amx / kernels.avx512_bf16 off (SERVELAB_CPU_AMX=0 / SERVELAB_CPU_DPBF16=0)"
)

ROWS = [1, 5, 12, 13, 16, 17, 31, 64, 100, 128]  # the AVX512-BF16 path: groups of 12 rows


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (50, 64), (49152, 576)])
def test_linear_matches_float32_reference_and_onednn(m, n, k) -> None:  # type: ignore[no-untyped-def]
    """Every row-tile remainder (M % 16) and column remainder (N % 32): the float32 product
    rounded once to bfloat16, and oneDNN's prepacked result to the last bit on nearly all."""
    torch.manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    got = amx_linear.amx_ops().amx_linear(x, amx_linear.pack(w), n)
    want = (x.float() @ w.float().t()).bfloat16()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-1)
    if prepack_supported(w):
        onednn = packed_linear(x, pack_weight(w))
        assert (got != onednn).float().mean().item() < 1e-3  # the same tile sums, order aside


@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_mul_equals_projection_then_silu_mul(m) -> None:  # type: ignore[no-untyped-def]
    """gate/up packed interleaved: silu(gate) * up straight from the tiles is bit-for-bit the
    plain projection (rounded to bfloat16) followed by the fused C++ silu_mul."""
    torch.manual_seed(m)
    inter = 1536
    w, x = torch.randn(2 * inter, 576).bfloat16(), torch.randn(m, 576).bfloat16()
    ops = amx_linear.amx_ops()
    projected = ops.amx_linear(x, amx_linear.pack(w), 2 * inter)
    fused = ops.amx_linear_silu_mul(x, amx_linear.pack(w, inter), inter)
    assert torch.equal(fused, kernels().silu_mul(projected))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", [49152, 50, 33])
def test_fused_argmax_equals_max_of_stored_logits(m, n) -> None:  # type: ignore[no-untyped-def]
    """The LM head's argmax without the logits: the first maximum of the logits as the plain
    kernel stores them (bfloat16), ties across column blocks and threads, infinities and NaN
    (a NaN counts as the maximum, the first one wins) included."""
    torch.manual_seed(m + n)
    w, x = torch.randn(n, 576).bfloat16(), torch.randn(m, 576).bfloat16()
    w[n // 2] = w[n // 3]  # two equal columns: equal logits in every row
    w[n // 3 + 1 :: 7] = w[1]
    if m > 2:
        x[1] = 0.0  # every logit 0: index 0
        x[2, 3] = float("inf")  # +-inf logits, NaN where the weight is 0
        w[5, 3] = 0.0
    ops, packed = amx_linear.amx_ops(), amx_linear.pack(w)
    logits = ops.amx_linear(x, packed, n)
    assert torch.equal(ops.amx_linear_argmax(x, packed, n), logits.max(dim=-1).indices)


def test_shapes_outside_the_kernels_are_refused() -> None:
    assert not amx_linear.supports(torch.randn(64, 40).bfloat16())  # K not a multiple of 32
    assert not amx_linear.supports(torch.randn(64, 64))  # float32
    assert not amx_linear.supports(torch.randn(40, 64).bfloat16(), interleave=20)  # 16 does not divide I
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx_linear.amx_ops().amx_pack(torch.randn(8, 40).bfloat16(), 0)


@pytest.mark.parametrize("m", [1, 13, 64])
def test_next_weight_prefetch_changes_no_result(m) -> None:  # type: ignore[no-untyped-def]
    """`next` (the following op's packed weight, prefetched while the last block is read) is a
    hint: every output is bit for bit the one without it, whatever the next weight's shape (fewer
    blocks than threads included); something that is not a packed weight is refused."""
    torch.manual_seed(m)
    ops = amx_linear.amx_ops()
    x, xi = torch.randn(m, 576).bfloat16(), torch.randn(m, 1536).bfloat16()
    qkv, gate_up = amx_linear.pack(torch.randn(960, 576).bfloat16()), amx_linear.pack(torch.randn(3072, 576).bfloat16(), 1536)
    down, tiny = amx_linear.pack(torch.randn(576, 1536).bfloat16()), amx_linear.pack(torch.randn(32, 64).bfloat16())
    for nxt in (gate_up, down, tiny):
        assert torch.equal(ops.amx_linear(x, qkv, 960, nxt), ops.amx_linear(x, qkv, 960))
        assert torch.equal(ops.amx_linear_silu_mul(x, gate_up, 1536, nxt), ops.amx_linear_silu_mul(x, gate_up, 1536))
        assert torch.equal(ops.amx_linear(xi, down, 576, nxt), ops.amx_linear(xi, down, 576, None))
    with pytest.raises(RuntimeError, match="an amx_pack or quant_pack result"):
        ops.amx_linear(x, qkv, 960, torch.zeros(4, 4))


def test_each_row_is_the_one_row_calls_bits() -> None:
    """model.batch_invariant's premise (engine/kernels/batch_invariance.py): row i of an M-row call
    is bit for bit the 1-row call on that row, for M 1..64 and past DECODE_MAX_ROWS (the
    batch-invariant plan runs every step size here): linear, fused silu * up, fused argmax."""
    torch.manual_seed(7)
    ops, inter = amx_linear.amx_ops(), 128
    w, gu, head = torch.randn(96, 576).bfloat16(), torch.randn(2 * inter, 576).bfloat16(), torch.randn(500, 576).bfloat16()
    pw, pgu, ph = amx_linear.pack(w), amx_linear.pack(gu, inter), amx_linear.pack(head)
    x = torch.randn(200, 576).bfloat16()
    calls = [lambda a: ops.amx_linear(a, pw, 96), lambda a: ops.amx_linear_silu_mul(a, pgu, inter),
             lambda a: ops.amx_linear_argmax(a, ph, 500)]  # fmt: skip
    alone = [torch.cat([f(x[i : i + 1]) for i in range(200)]) for f in calls]
    for m in [*range(1, 65), 129, 200]:
        for f, want in zip(calls, alone, strict=True):
            assert torch.equal(f(x[:m]), want[:m]), m
