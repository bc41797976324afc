"""The K-quant block linears (engine/kernels/csrc/kquant_blocks.h: Q4_K, Q6_K, through
engine/kernels/cpu_blocks.py) on AVX2 and by the scalar reference, against the float64 product of
gguf's own numpy dequantization; Gemma 3's checkpoint matrices (Q5_0, Q8_0, Q4_K, Q6_K) the same
way; a fused matrix of two block kinds (Gemma's q / k in Q5_0, v in Q8_0) read part by part.

The bound: x is rounded per 32-input block to s v (s = max |x| of the block / 16256, |error| <= s / 2
an input), and the integers multiplied are the weights before the float terms: Q6_K's d sc (q - 32)
(the weight itself: the offset rides in the integers), Q4_K's d sc q (the -dmin m term multiplies x's
exact sum). So an output's error is at most sum_k |d sc q|_k s_k / 2, plus float32's rounding of the
sums (2^-20 of sum |x w|, generous at these K)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import cpu_blocks

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

ops = cpu_blocks.block_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ toolchain built engine/kernels/csrc/block_linear.cpp")
KQUANTS = ("Q4_K", "Q6_K")


def random_superblocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n * k / 256, bytes]: random quant bytes and scales (Q6_K's int8 scales over their whole
    range, -128 included), fp16 d (and Q4_K's dmin) small positive values. gguf has no K-quant quantizer."""
    rng = np.random.default_rng(seed)
    nb = n * k // 256
    raw = rng.integers(0, 256, (nb, cpu_blocks.BLOCK_BYTES[kind]), dtype=np.uint8)
    d = (rng.random(nb) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if kind == "Q4_K":
        raw[:, 0:2] = d
        raw[:, 2:4] = (rng.random(nb) * 0.02).astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:
        raw[:, 208:210] = d
    return raw


def dequantized(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(n, k).astype(np.float64))


def multiplied_part(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """[n, k] float64: the part of each weight the integer products carry (module note)."""
    if kind == "Q4_K":
        raw = raw.copy()
        raw[:, 2:4] = 0  # dmin = 0: gguf's dequantizer gives d sc q
    return dequantized(kind, raw, n, k)


def error_bound(x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    m, k = xd.shape
    s = xd.abs().view(m, k // 32, 32).amax(-1) / 16256  # [M, K / 32]
    return (s.repeat_interleave(32, dim=1) / 2) @ part.abs().T + (xd.abs() @ part.abs().T) * 2.0**-20 + 1e-6


def as_blocks(raw: np.ndarray, n: int, k: int, weights: int = 256) -> torch.Tensor:
    return torch.from_numpy(raw.reshape(n, k // weights, -1).copy())


def check(kind: str, blocks: torch.Tensor, w: torch.Tensor, part: torch.Tensor, x: torch.Tensor) -> None:
    packed = cpu_blocks.pack(blocks, kind)
    ref = x.double() @ w.T
    bound = error_bound(x, part)
    for scalar in (False, True):
        y = ops.block_linear(x, packed, kind, scalar)  # type: ignore[union-attr]
        assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == torch.float32
        err = (y.double() - ref).abs()
        assert bool((err <= bound).all()), f"{kind} scalar={scalar}: worst {float((err / bound).max()):.2f}x the bound"
    assert float(bound.max()) < 0.01 * float(ref.abs().max())  # and not trivially


@pytest.mark.parametrize("kind", KQUANTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_kquants_match_the_dequantized_product(kind: str, rows: int) -> None:
    """37 columns (4-, 2- and 1-column groups and their tails), K = 768 (three super-blocks)."""
    n, k = 37, 768
    raw = random_superblocks(kind, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    check(kind, as_blocks(raw, n, k), dequantized(kind, raw, n, k), multiplied_part(kind, raw, n, k), x)


@pytest.mark.parametrize("kind", KQUANTS)
def test_extreme_weights_and_inputs_stay_in_the_integers_range(kind: str) -> None:
    """The largest products: Q6_K scales -128 and 127 with q - 32 = -32 and 31, Q4_K scales 63 and
    nibbles 15; every x at its block's maximum (v = 16256: hi 127), of both signs."""
    n, k = 8, 512
    raw = random_superblocks(kind, n, k, seed=11)
    if kind == "Q6_K":
        raw[:, :192] = np.where(np.arange(raw.shape[0])[:, None] % 2, 0xFF, 0x00)  # q = 63 or 0
        raw[:, 192:208] = np.array([-128, 127] * 8, dtype=np.int8).view(np.uint8)
    else:
        raw[:, 4:16] = 0xFF  # every scale and min 63
        raw[:, 16:] = 0xFF  # every nibble 15
    x = torch.full((3, k), 7.5)
    x[1] = -7.5
    x[2, ::2] = -7.5
    w = dequantized(kind, raw, n, k)
    packed = cpu_blocks.pack(as_blocks(raw, n, k), kind)
    ref = x.double() @ w.T
    for scalar in (False, True):  # x is exact in 14 bits here: only float32's rounding of the sums is left
        err = (ops.block_linear(x, packed, kind, scalar).double() - ref).abs()  # type: ignore[union-attr]
        assert bool((err <= (x.double().abs() @ w.abs().T) * 2.0**-20).all()), f"{kind} scalar={scalar}"


@pytest.mark.parametrize("kind", KQUANTS)
def test_vector_path_and_scalar_reference_sum_the_same_integers(kind: str) -> None:
    n, k = 40, 2048
    raw = random_superblocks(kind, n, k, seed=5)
    packed = cpu_blocks.pack(as_blocks(raw, n, k), kind)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    vec = ops.block_linear(x, packed, kind, False)  # type: ignore[union-attr]
    ref = ops.block_linear(x, packed, kind, True)  # type: ignore[union-attr]
    scale = x.abs() @ dequantized(kind, raw, n, k).abs().float().T
    assert bool(((vec - ref).abs() <= scale * 2.0**-18).all())


@pytest.mark.parametrize("kind", KQUANTS)
def test_bfloat16_rows_nan_and_refusals(kind: str) -> None:
    n, k = 16, 256
    raw = random_superblocks(kind, n, k, seed=2)
    packed = cpu_blocks.pack(as_blocks(raw, n, k), kind)
    x = torch.randn(2, k).bfloat16()
    y16 = ops.block_linear(x, packed, kind)  # type: ignore[union-attr]
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, ops.block_linear(x.float(), packed, kind).bfloat16())  # type: ignore[union-attr]
    bad = torch.randn(2, k)
    bad[0, 100], bad[1, 3] = float("nan"), float("inf")
    assert bool(ops.block_linear(bad, packed, kind).isnan().all())  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=rf"K \(96\) must be a multiple of 256 for {kind}"):
        ops.block_linear(torch.randn(1, 96), packed, kind)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=rf"block_pack: GGUF blocks uint8 \[N, K / 256, {cpu_blocks.BLOCK_BYTES[kind]}\]"):
        ops.block_pack(torch.zeros(4, 1, 22, dtype=torch.uint8), kind)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="Q4_1, Q8_0, Q5_0, Q4_K or Q6_K, got Q2_K"):
        ops.block_linear(torch.randn(1, k), packed, "Q2_K")  # type: ignore[union-attr]


def test_q4k_pack_unpacks_the_six_bit_scales_and_mins() -> None:
    """Packed Q4_K: d, dmin, sc[8], m[8] as bytes, the 128 nibble bytes; gguf's own unpacking agrees."""
    n, k = 3, 512
    raw = random_superblocks("Q4_K", n, k, seed=9)
    packed = cpu_blocks.pack(as_blocks(raw, n, k), "Q4_K").view(n, 2, 148).reshape(-1, 148).numpy()
    sc, mn = quants.Q4_K.get_scale_min(raw[:, 4:16])
    assert np.array_equal(packed[:, :4], raw[:, :4])
    assert np.array_equal(packed[:, 4:12], sc) and np.array_equal(packed[:, 12:20], mn)
    assert np.array_equal(packed[:, 20:], raw[:, 16:])
    q6 = random_superblocks("Q6_K", n, k, seed=9)
    assert np.array_equal(cpu_blocks.pack(as_blocks(q6, n, k), "Q6_K").numpy().reshape(-1, 210), q6)  # as stored


def test_a_fused_matrix_of_two_block_kinds_reads_each_part() -> None:
    """q / k rows in Q5_0 and v rows in Q8_0 in one Linear (Gemma 3's qkv): each part through its
    own kind, concatenated; the dense weight past the row limit; a part of the wrong shape refused."""
    rng = np.random.default_rng(1)
    parts, dense = [], []
    for kind, rows in (("Q5_0", 48), ("Q5_0", 16), ("Q8_0", 16)):
        w = rng.standard_normal((rows, 128)).astype(np.float32)
        raw = quants.quantize(w, getattr(GGMLQuantizationType, kind))
        parts.append((kind, torch.from_numpy(raw.view(np.uint8).reshape(rows, 4, -1).copy())))
        dense.append(torch.from_numpy(quants.dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(rows, 128)))
    layer = torch.nn.Linear(128, 80, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.cat(dense))
    assert cpu_blocks.attach_parts(layer, parts)
    assert "gguf_blocks" not in layer.__dict__ and [k for k, _ in layer.__dict__["gguf_parts"]] == ["Q5_0", "Q8_0"]
    with torch.inference_mode():
        x = torch.randn(2, 128)
        want = torch.cat([ops.block_linear(x, cpu_blocks.pack(torch.cat([parts[0][1], parts[1][1]]), "Q5_0"), "Q5_0"),  # type: ignore[union-attr]
                          ops.block_linear(x, cpu_blocks.pack(parts[2][1], "Q8_0"), "Q8_0")], dim=1)  # type: ignore[union-attr]
        assert torch.equal(layer(x), want)
        many = torch.randn(cpu_blocks.max_rows("Q5_0") + 1, 128)
        assert torch.equal(layer(many), torch.nn.functional.linear(many, layer.weight))
    cpu_blocks.detach(layer)
    assert "gguf_parts" not in layer.__dict__ and "forward" not in layer.__dict__
    assert not cpu_blocks.attach_parts(layer, parts[:2])  # rows short of the weight's
    assert "forward" not in layer.__dict__


@pytest.fixture(scope="module")
def gemma_reader():  # type: ignore[no-untyped-def]
    from engine.model.gguf_loader import open_gguf
    from engine.model.source import resolve_source

    try:
        return open_gguf(resolve_source("gemma3-270m").path)
    except ValueError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                                  "blk.0.ffn_down.weight", "blk.1.ffn_down.weight"])  # fmt: skip
@pytest.mark.serial  # a real Gemma 3 model (and HF's copy): GBs of memory, run alone (issue 58)
def test_gemma3_checkpoint_matrices(gemma_reader, name: str) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint's own blocks (real scales and quants, not random bytes), 1 and 3 rows."""
    tensor = next(t for t in gemma_reader.tensors if t.name == name)
    kind = tensor.tensor_type.name
    n, k = (int(d) for d in reversed(tensor.shape))
    raw = np.asarray(tensor.data).view(np.uint8).reshape(n * k // cpu_blocks.block_weights(kind), -1)
    part = multiplied_part(kind, raw, n, k) if kind in KQUANTS else dequantized(kind, raw, n, k)
    if kind == "Q5_0":  # the integers carry d q, q in 0..31 (the -16 d sx term multiplies x's exact sum)
        part = dequantized(kind, raw, n, k) + 16 * torch.from_numpy(raw[:, :2].copy().view(np.float16).astype(np.float64)).view(n, k // 32, 1).expand(n, k // 32, 32).reshape(n, k)
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        check(kind, as_blocks(raw, n, k, cpu_blocks.block_weights(kind)), dequantized(kind, raw, n, k), part, x)


@pytest.mark.serial  # a real Gemma 3 model (and HF's copy): GBs of memory, run alone (issue 58)
def test_gemma3_decodes_on_its_blocks(gemma_reader) -> None:  # type: ignore[no-untyped-def]
    """`model=gemma3-270m` with `model.quantized_decode` (the default): every layer matrix and the LM
    head read the checkpoint's blocks at steps of up to 8 rows (q / k / v as Q5_0 + Q8_0 parts where v
    is Q8_0), no start-up warning, what a run's summary.json plans is what runs, and the greedy tokens
    of 1- and 3-row steps are the dense float32 model's (the blocks' x rounding, 2^-15 of a block's
    largest |x|, moves no argmax on these prompts: seen equal over 24 tokens, 16 checked here)."""
    from engine import LLM, SamplingParams
    from engine.kernels.kernel_choices import quantized_decode_fallback
    from engine.model.gguf_loader import gguf_layer_kinds
    from engine.model.loader import planned_step_weights

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    common = dict(model="gemma3-270m", dtype="float32", max_num_seqs=4, num_blocks=256, max_model_len=256)
    on = LLM(quantized_decode=True, **common)  # type: ignore[arg-type]
    model = on.engine_core.executor.worker.model
    layer = model.model.layers[0]
    assert [k for k, _ in layer.self_attn.qkv_proj.__dict__["gguf_parts"]] == ["Q5_0", "Q8_0"]  # blk.0: v in Q8_0
    assert [k for k, _ in layer.mlp.down_proj.__dict__["gguf_parts"]] == ["Q6_K"]
    assert [k for k, _ in layer.self_attn.o_proj.__dict__["gguf_parts"]] == ["Q4_K"]
    assert model.block_lm_head is not None and model.block_lm_head[0] == "Q8_0"
    weights = model.step_weights()
    assert weights == {"rows<=8": "layers: gguf Q4_K/Q5_0/Q6_K/Q8_0 blocks; LM head: gguf Q8_0 blocks",
                       "rows>8": "float32"} if cpu_blocks.isa() == "avx2" else "rows<=1" in weights  # fmt: skip
    assert planned_step_weights(on.engine_core.config.model, "float32") == weights
    if cpu_blocks.isa() == "avx2":
        assert quantized_decode_fallback(model, True, False, gguf_layer_kinds) is None
    got = [list(o.outputs[0].token_ids) for o in on.generate(prompts, sp, use_tqdm=False)]
    single = [list(on.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    del on, model, layer
    off = LLM(quantized_decode=False, **common)  # type: ignore[arg-type]
    assert off.engine_core.executor.worker.model.step_weights() == {"all": "float32"}
    want = [list(o.outputs[0].token_ids) for o in off.generate(prompts, sp, use_tqdm=False)]
    assert got == want and single == want
