"""The decode linears on a GGUF checkpoint's own Q4_1 / Q8_0 blocks (engine/kernels/csrc/gguf_blocks.h): the
checkpoint's own products, held against float64 sums of the unrounded weights (their one rounding
to bfloat16 and a float32 accumulation apart), and the engine's greedy tokens on them the float32
model's choices (CPUs with AVX512-BF16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import amx_linear
from engine.model.gguf_loader import (
    _dequantize_q4_1,
    _dequantize_q8_0,
    load_gguf_blocks,
    load_gguf_state_dict,
    read_gguf_arch,
)

pytestmark = pytest.mark.skipif(
    not amx_linear.quant_available(), reason="no AVX512-BF16 and AVX512-VNNI on this CPU (or kernels.avx512_bf16=false)"
)

ROWS = [1, 2, 3, 4, 7, 8, 9, 17, 33, 64]  # groups of 8 rows, row tiles of 16, pairs of tiles (32)
DEQUANT = {"Q4_1": (_dequantize_q4_1, 20), "Q8_0": (_dequantize_q8_0, 34)}


def random_blocks(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF blocks [n, k / 32, bytes] of `kind` and the bfloat16 weight the loader makes of them."""
    g = np.random.default_rng(seed)
    fn, nbytes = DEQUANT[kind]
    raw = g.integers(0, 256, size=(n * (k // 32), nbytes), dtype=np.uint8)
    scales = (g.standard_normal((n * (k // 32), 2)) * 0.02).astype(np.float16)  # d (and m for Q4_1)
    raw[:, 0:2] = scales[:, :1].view(np.uint8)
    if kind == "Q4_1":
        raw[:, 2:4] = scales[:, 1:].view(np.uint8)
    blocks = torch.from_numpy(raw)
    weight = fn(blocks).reshape(n, k).to(torch.bfloat16)  # the loader's own arithmetic
    return blocks.reshape(n, k // 32, nbytes), weight


def exact_weight(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' weights as the checkpoint defines them (d q + m, not rounded to bfloat16), float64."""
    fn, nbytes = DEQUANT[kind]
    return fn(blocks.reshape(-1, nbytes)).reshape(blocks.shape[0], -1).double()


def x_rounding(x: torch.Tensor) -> torch.Tensor:
    """The most each x value moves when the kernels write it in 16-bit integers (gguf_blocks.h:
    half a step of its 32-input block's largest |x| / 32512), float64 [M, K]."""
    amax = x.double().abs().reshape(x.shape[0], -1, 32).amax(dim=-1)
    return (amax / 32512 / 2).repeat_interleave(32, dim=1)


def within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """got [M, N] (the kernel's bfloat16 output) against x @ w.T in float64: off by at most its
    rounding to bfloat16 (2^-8 relative), 2^-20 of sum |x w| (the float32 sums; measured <= 2.2e-7)
    and x's rounding to 16 bits times |w|."""
    xd = x.double()
    want, scale = xd @ w.T, xd.abs() @ w.abs().T
    return (got.double() - want).abs() <= want.abs() * 2**-8 + scale * 2**-20 + x_rounding(x) @ w.abs().T


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64), (50, 96)])
def test_linear_and_argmax_are_the_checkpoints_products(kind, n, k) -> None:  # type: ignore[no-untyped-def]
    """Every row count and a column count that leaves half a block (48) or less (50); the argmax
    picks a column whose exact logit is within the output's bfloat16 rounding of the exact maximum."""
    blocks, w = random_blocks(kind, n, k, seed=n + k)
    packed = amx_linear.quant_pack(blocks, kind, w)
    assert packed is not None and packed.dtype == torch.uint8
    bits = packed.nbytes * 8 / (-(-n // 32) * 32 * k)  # per weight of the padded columns
    assert bits == (5 if kind == "Q4_1" else 8.5)  # not bfloat16's 16
    ops, exact = amx_linear.amx_ops(), exact_weight(kind, blocks)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert within_rounding(ops.amx_linear(x, packed, n), x, exact).all(), m
        want = x.double() @ exact.T
        picked = want.gather(1, ops.amx_linear_argmax(x, packed, n)[:, None])[:, 0]
        best = want.max(dim=1).values
        slack = (x.double().abs() @ exact.abs().T) * 2**-19 + 2 * (x_rounding(x) @ exact.abs().T)
        assert (picked >= best - best.abs() * 2**-7 - slack.max(dim=1).values).all(), m


@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_mul_is_the_checkpoints_products(m) -> None:  # type: ignore[no-untyped-def]
    """silu(gate) * up of the exact projections, each rounded to bfloat16 first (as the kernel and
    the unfused path do): within those roundings, propagated, and the output's."""
    inter = 1536
    gate, w_gate = random_blocks("Q4_1", inter, 576, seed=1)
    up, w_up = random_blocks("Q4_1", inter, 576, seed=2)
    packed = amx_linear.quant_pack(torch.cat([gate, up]), "Q4_1", torch.cat([w_gate, w_up]), inter)
    assert packed is not None
    ops = amx_linear.amx_ops()
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).bfloat16()
    down, wd = random_blocks("Q4_1", 576, inter, seed=3)
    nxt = amx_linear.quant_pack(down, "Q4_1", wd)
    got = ops.amx_linear_silu_mul(x, packed, inter)
    assert torch.equal(ops.amx_linear_silu_mul(x, packed, inter, nxt), got)  # the prefetch hand-off changes nothing
    xd, wg, wu = x.double(), exact_weight("Q4_1", gate), exact_weight("Q4_1", up)
    g, u = xd @ wg.T, xd @ wu.T
    ex = x_rounding(x)
    dg = g.abs() * 2**-8 + (xd.abs() @ wg.abs().T) * 2**-20 + ex @ wg.abs().T  # each projection's error bound
    du = u.abs() * 2**-8 + (xd.abs() @ wu.abs().T) * 2**-20 + ex @ wu.abs().T
    want = torch.nn.functional.silu(g) * u
    tol = 1.1 * dg * (u.abs() + du) + torch.nn.functional.silu(g).abs() * du + want.abs() * 2**-7
    assert ((got.double() - want).abs() <= tol * 1.05 + 1e-6).all()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_integer_sums_are_exact_where_x_takes_16_bits(kind) -> None:  # type: ignore[no-untyped-def]
    """x whose blocks are whole numbers with a largest |x| of 127 is written exactly (v = 256 x), so
    the kernels' integer sums leave only the float32 folding and the output's bfloat16 rounding;
    an all-zero block adds nothing, a block holding an inf or a NaN makes its row's outputs NaN."""
    n, k = 96, 128
    blocks, _ = random_blocks(kind, n, k, seed=11)
    packed = amx_linear.quant_pack(blocks, kind, random_blocks(kind, n, k, seed=11)[1])
    assert packed is not None
    ops, exact = amx_linear.amx_ops(), exact_weight(kind, blocks)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-127, 128, (5, k), generator=g).float()
    x[:, ::32] = 127.0  # every block's largest |x| is 127
    x[3, 32:64] = 0.0  # a zero block
    x = x.bfloat16()  # whole numbers up to 127: exact in bfloat16
    got, want = ops.amx_linear(x, packed, n).double(), x.double() @ exact.T
    assert ((got - want).abs() <= want.abs() * 2**-8 + (x.double().abs() @ exact.abs().T) * 2**-20).all()
    bad = x.clone()
    bad[1, 40], bad[2, 3] = float("inf"), float("nan")
    out = ops.amx_linear(bad, packed, n)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[[0, 3, 4]], ops.amx_linear(x[[0, 3, 4]], packed, n))  # other rows untouched


def test_blocks_that_do_not_reproduce_the_weight_are_refused() -> None:
    """One weight off by a bfloat16 step (or blocks of another matrix): no pack, so the caller keeps
    the bfloat16 kernels; a kind or shape the ops do not take: no pack either."""
    blocks, w = random_blocks("Q4_1", 64, 64, seed=5)
    off = w.clone()
    off[37, 41] = off[37, 41].float() * 1.5 + 0.01
    assert amx_linear.quant_pack(blocks, "Q4_1", off) is None
    assert amx_linear.quant_pack(random_blocks("Q4_1", 64, 64, seed=6)[0], "Q4_1", w) is None
    assert amx_linear.quant_pack(blocks, "Q5_K", w) is None
    assert amx_linear.quant_pack(blocks, "Q4_1", w[:, :32]) is None
    assert amx_linear.quant_pack(blocks, "Q4_1", w) is not None


def test_embedded_model_blocks_are_its_weights() -> None:
    """load_gguf_blocks: each Q4_1 / Q8_0 matrix of the default model, dequantized by the loader's
    own arithmetic, is the state dict's weight (Q/K rows un-permuted alike); two layers suffice."""
    from engine.model.source import embedded_gguf_path

    path = embedded_gguf_path()
    arch = read_gguf_arch(path).with_num_layers(2)
    blocks = load_gguf_blocks(path, arch)
    state = load_gguf_state_dict(path, arch, torch.float32)
    assert set(blocks) == {n for n in state if n.endswith("_proj.weight") or n == "model.embed_tokens.weight"}
    assert {kind for kind, _ in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, (kind, raw) in blocks.items():
        fn, nbytes = DEQUANT[kind]
        assert torch.equal(fn(raw.reshape(-1, nbytes)).reshape(state[name].shape), state[name]), name


def test_engine_tokens_on_the_blocks_are_float32s_choices() -> None:
    """bfloat16 greedy decoding of the default model at batch 1-3 (the blocks' steps): every token
    is the float32 model's top choice on the same sequence, or within bfloat16's logit noise of it
    (LOGIT_ATOL x the position's logit std, the bar tests/test_oracle_bf16.py sets for bfloat16
    against float32); with `model.quantized_decode` off the blocks are not read."""
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig
    from tests.test_oracle_bf16 import LOGIT_ATOL, _prompt_logits

    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["The lighthouse keeper found", "List three prime numbers:", "Paris is"]
    off = LLM(dtype="bfloat16", quantized_decode=False, num_blocks=64).engine_core.executor.worker.model
    assert not off.model.plan.quant and off.quant_lm_head is None
    assert off.step_weights() == {"all": "bfloat16 (loader-rounded)"}
    llm = LLM(dtype="bfloat16", quantized_decode=True, num_blocks=64)
    model = llm.engine_core.executor.worker.model
    assert model.model.plan.quant and model.quant_lm_head is not None
    assert model.step_weights() == {"rows<=6": "layers: gguf Q4_1 blocks; LM head: gguf Q8_0 blocks",
                                    "rows 7-10": "layers: gguf Q4_1 blocks; LM head: bfloat16 (loader-rounded)",
                                    "rows>10": "bfloat16 (loader-rounded)"}  # fmt: skip
    from engine.model.loader import planned_step_weights  # what a run's summary.json records

    assert planned_step_weights(llm.engine_core.config.model, "bfloat16") == model.step_weights()
    assert planned_step_weights(ModelConfig(quantized_decode=False), "bfloat16") == off.step_weights()
    outs = llm.generate(prompts, sp, use_tqdm=False) + [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    top1 = total = 0
    for out in outs:
        ids, gen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        logits = _prompt_logits("float32", ids + gen)[len(ids) - 1 : -1]
        for row, tok in zip(logits, gen, strict=True):
            gap = (row.max() - row[tok]).item()
            assert gap <= LOGIT_ATOL * row.std().item(), (out.prompt, gen, tok, gap)
            top1 += gap == 0
            total += 1
    print(f"blocks: {top1} of {total} greedy tokens the float32 model's top choice, the rest within bfloat16's noise")
