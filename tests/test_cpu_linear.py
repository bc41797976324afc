"""Prepacked oneDNN linears (engine/kernels/cpu_linear.py) against plain `F.linear`, bfloat16 on a CPU.

Both multiply the same bfloat16 values with float32 accumulation and round once, in another
blocking order: they agree to ~1 bfloat16 ulp of the output (rtol 1e-2 plus a small atol).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_linear
from engine.kernels.cpu_linear import pack_weight, packed_linear, prepack_linears, prepack_supported

pytestmark = pytest.mark.skipif(
    not prepack_supported(torch.empty(1, 1, dtype=torch.bfloat16)),
    reason="no oneDNN bfloat16 kernels: this torch lacks oneDNN or this CPU lacks avx512bw/vl/dq and avx_ne_convert",
)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576)])
def test_packed_linear_matches_plain(rows: int, shape: tuple[int, int]) -> None:
    torch.manual_seed(rows)
    w = (torch.randn(shape) / shape[1] ** 0.5).bfloat16()
    x = torch.randn(rows, shape[1]).bfloat16()
    got, want = packed_linear(x, pack_weight(w)), F.linear(x.float(), w.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2)
    # 3-D inputs and non-contiguous rows take the reshape path
    x3 = torch.randn(2, rows, shape[1]).bfloat16().transpose(0, 1)
    torch.testing.assert_close(packed_linear(x3, pack_weight(w)).float(), F.linear(x3, w).float(), rtol=1e-2, atol=2e-2)


def test_prepack_linears_only_touches_bf16_cpu_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    # float32 layers are prepacked only where the start-up probe finds oneDNN faster: not here
    monkeypatch.setattr(cpu_linear, "onednn_float32_faster", lambda: False)
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 16)).bfloat16()
    model.append(nn.Linear(16, 8).float())  # float32: left as it is
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        before = model[1](model[0](x))
        assert prepack_linears(model) == 2
        after = model[1](model[0](x))
    assert "forward" in model[0].__dict__ and "forward" in model[1].__dict__ and "forward" not in model[2].__dict__
    torch.testing.assert_close(after.float(), before.float(), rtol=1e-2, atol=2e-2)
    # with autograd on, the plain weight is used (the packed op has no backward)
    y = model[1](model[0](x.requires_grad_()))
    y.sum().backward()
    assert x.grad is not None


def test_engine_tokens_equal_with_and_without_prepacking() -> None:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 10, list(range(100, 140))]
    outs = []
    for prepack in (True, False):
        llm = LLM(model="smollm2", load_format="dummy", num_layers_override=2, dtype="bfloat16",
                  prepack_weights=prepack, num_blocks=64, max_num_seqs=4)
        assert (llm.engine_core.executor.worker.model.packed_lm_head is not None) == prepack  # type: ignore[attr-defined]
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tied", [True, False])
def test_model_prepack_packs_the_lm_head_once(tied: bool) -> None:
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model.arch import ModelArch
    from engine.model.llama import LlamaForCausalLM

    arch = ModelArch(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                     vocab_size=300, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                     tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(arch, TorchAttentionBackend()).bfloat16()
    hidden = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        plain = model.compute_logits(hidden)
        packed = model.prepack()
        assert packed == 5  # qkv, o, gate_up, down, and the LM head (tied: packed apart; untied: a linear)
        if not tied:
            assert model.packed_lm_head is model.lm_head.__dict__["packed_weight"]  # type: ignore[union-attr]
        torch.testing.assert_close(model.compute_logits(hidden), plain, rtol=1e-2, atol=2e-2)


def test_planned_forward_equals_the_modules_forward_bit_for_bit() -> None:
    """The planned forward (a flat list of op calls, built by prepack) computes exactly what the
    modules compute, on chunked-prefill, mixed and decode steps through the paged cache: with
    the same linear kernels (oneDNN's; the decode-sized AMX / AVX512-BF16 kernels sum in another
    order than oneDNN on a CPU without AMX, tests/test_amx_linear.py checks them against references)."""
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model="smollm2", load_format="dummy", num_layers_override=3, dtype="bfloat16", num_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=32)  # chunked prefill + decode + mixed steps
    model = llm.engine_core.executor.worker.model  # type: ignore[attr-defined]
    inner = model.model
    if inner.plan is None:
        pytest.skip("the fused C++ layer ops are not built here (no C++ toolchain)")
    hidden: list[list[torch.Tensor]] = [[], []]
    forward = inner.forward

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = forward(*args, **kwargs)
        hidden[record].append(out.clone())
        return out

    inner.forward = recording
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(100, 140)), [7, 8, 9] * 7, [5, 6]]
    plan = dataclasses.replace(inner.plan, amx_ops=None)  # the modules' linear kernels (docstring)
    tokens = []
    for record in (0, 1):
        inner.plan = plan if record == 0 else None
        llm.reset_prefix_cache()
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]
    assert len(hidden[0]) == len(hidden[1]) > 3
    for a, b in zip(hidden[0], hidden[1], strict=True):
        assert torch.equal(a, b)


def test_padded_rows_are_few_shapes() -> None:
    from engine.kernels.cpu_linear import padded_rows

    assert [padded_rows(r) for r in (1, 8, 9, 128, 129, 160, 161, 2048)] == [8, 8, 16, 128, 160, 160, 192, 2048]
    assert len({padded_rows(r) for r in range(1, 2049)}) == 16 + 60  # what warm_up_linears builds
    x, w = torch.randn(150, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    got = packed_linear(x, pack_weight(w))  # 150 rows run as 160, cut back to 150
    assert got.shape == (150, 40)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=5e-2)


def test_planned_forward_on_padded_prefill_steps_gives_the_modules_tokens() -> None:
    """Steps of more than 128 rows (oneDNN, rows padded to a multiple of 32) against the modules'
    forward: the same greedy tokens, hidden states within bfloat16 rounding; `warm_up_linears`
    builds every padded shape first."""
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model="smollm2", load_format="dummy", num_layers_override=2, dtype="bfloat16", num_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=300, warm_up_linears=True)
    model = llm.engine_core.executor.worker.model  # type: ignore[attr-defined]
    inner = model.model
    if inner.plan is None:
        pytest.skip("the fused C++ layer ops are not built here (no C++ toolchain)")
    assert llm.engine_core.executor.worker.compile_time > 0  # type: ignore[attr-defined]
    hidden: list[list[torch.Tensor]] = [[], []]
    forward = inner.forward

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = forward(*args, **kwargs)
        hidden[record].append(out.clone())
        return out

    inner.forward = recording
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [list(range(100, 250)), list(range(300, 337))]  # one step of 187 rows, then decodes
    plan, tokens = inner.plan, []
    for record in (0, 1):
        inner.plan = plan if record == 0 else None
        llm.reset_prefix_cache()
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]
    assert hidden[0][0].shape == hidden[1][0].shape == (187, 576)  # the padding rows are cut off
    torch.testing.assert_close(hidden[0][0].float(), hidden[1][0].float(), rtol=5e-2, atol=5e-2)
