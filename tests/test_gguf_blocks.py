"""The decode linears on a GGUF checkpoint's own Q4_1 / Q8_0 blocks (engine/csrc/gguf_blocks.h):
bit for bit the bfloat16 kernels on the weights the loader makes of the same blocks, and the
engine's tokens the same with them on or off (CPUs with AVX512-BF16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import amx_linear
from engine.model.gguf_loader import (
    _dequantize_q4_1,
    _dequantize_q8_0,
    load_gguf_blocks,
    load_gguf_state_dict,
    read_gguf_arch,
)

pytestmark = pytest.mark.skipif(
    not amx_linear.quant_available(), reason="no AVX512-BF16 on this CPU (or SERVELAB_CPU_QUANT=0 / SERVELAB_CPU_DPBF16=0)"
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


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64), (50, 96)])
def test_linear_and_argmax_equal_the_bfloat16_kernels(kind, n, k) -> None:  # type: ignore[no-untyped-def]
    """Every row count and a column count that leaves half a block (48) or less (50)."""
    blocks, w = random_blocks(kind, n, k, seed=n + k)
    packed = amx_linear.quant_pack(blocks, kind, w)
    assert packed is not None and packed.dtype == torch.uint8
    bits = packed.nbytes * 8 / (-(-n // 32) * 32 * k)  # per weight of the padded columns
    assert bits == (5 if kind == "Q4_1" else 8.5)  # not bfloat16's 16
    ops, ref = amx_linear.amx_ops(), amx_linear.pack(w)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert torch.equal(ops.amx_linear(x, packed, n), ops.amx_linear(x, ref, n)), m
        assert torch.equal(ops.amx_linear_argmax(x, packed, n), ops.amx_linear_argmax(x, ref, n)), m


@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_mul_equals_the_bfloat16_kernel(m) -> None:  # type: ignore[no-untyped-def]
    inter = 1536
    gate, wg = random_blocks("Q4_1", inter, 576, seed=1)
    up, wu = random_blocks("Q4_1", inter, 576, seed=2)
    w = torch.cat([wg, wu])
    packed = amx_linear.quant_pack(torch.cat([gate, up]), "Q4_1", w, inter)
    assert packed is not None
    ops = amx_linear.amx_ops()
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).bfloat16()
    down, wd = random_blocks("Q4_1", 576, inter, seed=3)
    nxt = amx_linear.quant_pack(down, "Q4_1", wd)
    want = ops.amx_linear_silu_mul(x, amx_linear.pack(w, inter), inter)
    assert torch.equal(ops.amx_linear_silu_mul(x, packed, inter), want)
    assert torch.equal(ops.amx_linear_silu_mul(x, packed, inter, nxt), want)  # the prefetch hand-off changes nothing


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
    from engine.model.loader import embedded_gguf_path

    path = embedded_gguf_path()
    arch = read_gguf_arch(path).with_num_layers(2)
    blocks = load_gguf_blocks(path, arch)
    state = load_gguf_state_dict(path, arch, torch.float32)
    assert set(blocks) == {n for n in state if n.endswith("_proj.weight") or n == "model.embed_tokens.weight"}
    assert {kind for kind, _ in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, (kind, raw) in blocks.items():
        fn, nbytes = DEQUANT[kind]
        assert torch.equal(fn(raw.reshape(-1, nbytes)).reshape(state[name].shape), state[name]), name


def test_engine_tokens_are_the_same_with_and_without_the_blocks() -> None:
    """bfloat16 greedy decoding of the default model at batch 1-3 (the quant kernels' steps) gives
    the same tokens with `model.quantized_decode` on and off; on, the model reads its blocks."""
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["The lighthouse keeper found", "List three prime numbers:", "Paris is"]
    got = {}
    for on in (True, False):
        llm = LLM(dtype="bfloat16", quantized_decode=on, num_blocks=64)
        model = llm.engine_core.executor.worker.model
        assert model.model.plan.quant is on and (model.quant_lm_head is not None) is on
        got[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        got[on] += [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got[True] == got[False]
