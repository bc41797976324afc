"""The decoder layers on the checkpoint's GGUF blocks in one C++ call (engine/kernels/block_layers.py)
against the planned forward's Python loop: the same hidden states bit for bit on every decode step
of the real SmolLM2 GGUF (float32 activations, the AVX2 or scalar block kernels), at 1 and 3 rows;
steps with prefill rows and observed attention keep the loop, a profiled step names every kernel,
and `kernels.block_layers=false` turns the op off."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from plan_helpers import PhaseNames, model_of, run_with_and_without

from engine.config import KernelsConfig
from engine.frontend.llm import LLM
from engine.hooks import NULL_HOOKS, observe_attention
from engine.kernels import cpu_blocks, options
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2", dtype="float32", max_num_seqs=3, max_model_len=512)


def _needs_op(llm: LLM) -> Any:
    """The plan with its block_layers op; a skip only where no C++ toolchain builds the block kernels:
    a float32 engine on the GGUF reads its blocks on every CPU with one (the AVX2 or the scalar build),
    whatever the float32 probe chose for the larger steps."""
    if cpu_blocks.isa() is None:
        pytest.skip("block_layers needs the C++ block kernels (cpu_blocks), which no toolchain built here")
    plan = model_of(llm).model.plan
    assert plan is not None and plan.block_max_rows, "the decode steps do not read the GGUF blocks"
    from engine.kernels import block_layers, cpu_extension

    assert plan.block_layers is not None, (
        f"block_layers not in the plan: kernels.block_layers={options.current().block_layers}, "
        f"op loaded={block_layers.loaded()}, builds in this process={cpu_extension._built}")
    return plan


@pytest.mark.parametrize("team", [True, False], ids=["team", "dispatcher"])
@pytest.mark.parametrize("rows", [1, 3])
@torch.inference_mode()
def test_op_equals_the_python_loop_on_the_checkpoints_blocks(llm: LLM, rows: int, team: bool) -> None:
    """Both ways the op runs its steps: the team step (one parallel region, on builds without AVX-512) and
    the kernels called one by one through the dispatcher."""
    from engine.kernels import block_layers

    plan = _needs_op(llm)
    if rows > plan.block_max_rows:
        pytest.skip(f"the scalar block build reads the blocks at {plan.block_max_rows} row(s) only (no AVX2 + FMA)")
    if team and not torch.ops.servelab.set_block_team(True):
        block_layers.apply_options()
        pytest.skip("the team step runs on builds without AVX-512 (their attention is the split path): this build "
                    "has it; tests/test_csrc_targets.py runs this file on the AVX2 build (x86-64-v3)")
    torch.ops.servelab.set_block_team(team)
    steps = torch.ops.servelab.block_team_steps()
    prompts = [list(range(200 + 40 * i, 232 + 40 * i + 5 * i)) for i in range(rows)]
    try:
        tokens, hidden, calls = run_with_and_without(llm, "block_layers", prompts, 8)
    finally:
        block_layers.apply_options()
    assert torch.ops.servelab.block_team_steps() - steps == (calls if team else 0)
    assert tokens[0] == tokens[1]
    assert calls == 7  # every step after the prompts' one prefill step
    assert len(hidden[0]) == len(hidden[1]) == 8
    for a, b in zip(hidden[0], hidden[1], strict=True):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_a_plan_on_the_blas_weights_reads_the_blocks_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the float32 probe keeps the plain BLAS for the larger steps (oneDNN not clearly faster here,
    as a loaded machine can measure, or `kernels.float32_linear=plain`), the plan is made all the same, on
    the plain weights, and its decode steps run the op on the blocks. Before, no plan was made there, and
    the op was lost without a word."""
    if cpu_blocks.isa() is None:
        pytest.skip("block_layers needs the C++ block kernels (cpu_blocks), which no toolchain built here")
    before = options.current()
    monkeypatch.setenv("SERVELAB_ONEDNN_FP32", "0")
    try:
        blas = LLM(model="smollm2", dtype="float32", max_num_seqs=1, max_model_len=256)
        plan = _needs_op(blas)
        assert not plan.onednn
        tokens, hidden, calls = run_with_and_without(blas, "block_layers", [list(range(300, 340))], 6)
        assert tokens[0] == tokens[1] and calls == 5
        for a, b in zip(hidden[0], hidden[1], strict=True):
            assert torch.equal(a, b)
    finally:
        options.configure(before)


@torch.inference_mode()
def test_a_profiled_step_names_every_kernel(llm: LLM) -> None:
    _needs_op(llm)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([list(range(300, 320))], params, use_tqdm=False)
    names = {e.key for e in prof.key_averages()}
    assert {"servelab::planned_block_layers_bound", "servelab::block_linear", "servelab::paged_attention",
            "servelab::plan:linears", "servelab::plan:attention", "servelab::plan:mlp"} <= names  # fmt: skip


@torch.inference_mode()
def test_observed_attention_keeps_the_loop(llm: LLM) -> None:
    """engine/hooks.observe_attention wraps each layer's attention call in a phase range: with hooks
    on, the op must not bypass it."""
    plan = _needs_op(llm)
    backend = plan.layers[0].attn.attn_backend
    hooks = PhaseNames()
    observe_attention(backend, hooks)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert backend.decode_rows() is None
    finally:
        observe_attention(backend, NULL_HOOKS)
    assert hooks.names.count("attention") == 4 * len(plan.layers)  # every step, every layer


def test_switched_off_by_the_config_and_its_variable(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import block_layers

    plan = _needs_op(llm)
    inner = model_of(llm).model
    before = options.current()
    try:
        options.configure(dataclasses.replace(before, block_layers=False))
        assert block_layers.bind(plan.layers, inner.norm.weight, plan.sizes[1], inner.norm.eps) is None
        options.configure(dataclasses.replace(before, block_layers=True))
        assert block_layers.bind(plan.layers, inner.norm.weight, plan.sizes[1], inner.norm.eps) is not None
    finally:
        options.configure(before)
    # the team step follows kernels.decode_team through options.configure (block_layers.apply_options)
    built = torch.ops.servelab.set_block_team(True)  # False on a build with AVX-512: it has no team step
    try:
        options.configure(dataclasses.replace(before, decode_team=False))
        assert torch.ops.servelab.set_block_team(None) is False
        options.configure(dataclasses.replace(before, decode_team=True))
        assert torch.ops.servelab.set_block_team(None) is built
    finally:
        options.configure(before)
    monkeypatch.setenv("SERVELAB_BLOCK_LAYERS", "0")
    assert KernelsConfig().block_layers is False
    monkeypatch.setenv("SERVELAB_BLOCK_LAYERS", "1")
    assert KernelsConfig(block_layers=False).block_layers is True


def test_mismatched_lists_are_refused_in_one_line() -> None:
    from engine.kernels import block_layers

    if not block_layers.loaded():
        pytest.skip("no C++ toolchain: block_layers.cpp cannot be built")
    t = torch.zeros(4)
    with pytest.raises(RuntimeError, match="per layer one KV cache, two norms, four block matrices"):
        torch.classes.servelab.BlockLayerArgs([t], [t], [t, t, t], ["Q4_1"] * 3, t, [1, 1, 64, 64], 1e-5, 0.1)
    with pytest.raises(RuntimeError, match=r"shape \(Hq, Hkv, head_dim, hidden\)"):
        torch.classes.servelab.BlockLayerArgs([t], [t, t], [t] * 4, ["Q4_1"] * 4, t, [1, 1, 64], 1e-5, 0.1)
