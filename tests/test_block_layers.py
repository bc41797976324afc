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

from engine.config import KernelsConfig
from engine.frontend.llm import LLM
from engine.hooks import NULL_HOOKS, NullHooks, observe_attention
from engine.kernels import options
from engine.sampling_params import SamplingParams


def _model(llm: LLM) -> Any:
    return llm.engine_core.executor.worker.model  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2", dtype="float32", max_num_seqs=3, max_model_len=512)


def _needs_op(llm: LLM) -> Any:
    plan = _model(llm).model.plan
    if plan is None or not plan.block_max_rows:
        pytest.skip("block_layers runs where the decode steps read the GGUF blocks with the AVX2 / scalar kernels "
                    "(a CPU without AVX512-BF16 + VNNI, whose quant packs take those steps) and a C++ toolchain")
    if plan.block_layers is None:  # the blocks path without its op: say which condition failed
        from engine.kernels import block_layers, cpu_extension

        pytest.skip(f"block_layers not in the plan: kernels.block_layers={options.current().block_layers}, "
                    f"op loaded={block_layers.loaded()}, builds in this process={cpu_extension._built}")
    return plan


def _run_both(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], list[list[torch.Tensor]], int]:
    """Tokens and every step's hidden states with the op and without it (the Python loop), and how
    many steps the op ran."""
    inner = _model(llm).model
    plan = inner.plan
    calls = [0]

    def counting(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return plan.block_layers(*args)

    forward = inner.forward
    hidden: list[list[torch.Tensor]] = [[], []]
    tokens = []
    side = [0]  # 0: with the op, 1: without

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        hidden[side[0]].append(out.clone())
        return out

    inner.forward = recording
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        for side[0], p in enumerate((dataclasses.replace(plan, block_layers=counting),
                                     dataclasses.replace(plan, block_layers=None))):  # fmt: skip
            inner.plan = p
            llm.reset_prefix_cache()
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    finally:
        inner.forward, inner.plan = forward, plan
    return tokens, hidden, calls[0]


@pytest.mark.parametrize("rows", [1, 3])
@torch.inference_mode()
def test_op_equals_the_python_loop_on_the_checkpoints_blocks(llm: LLM, rows: int) -> None:
    plan = _needs_op(llm)
    if rows > plan.block_max_rows:
        pytest.skip(f"the scalar block build reads the blocks at {plan.block_max_rows} row(s) only (no AVX2 + FMA)")
    prompts = [list(range(200 + 40 * i, 232 + 40 * i + 5 * i)) for i in range(rows)]
    tokens, hidden, calls = _run_both(llm, prompts, 8)
    assert tokens[0] == tokens[1]
    assert calls == 7  # every step after the prompts' one prefill step
    assert len(hidden[0]) == len(hidden[1]) == 8
    for a, b in zip(hidden[0], hidden[1], strict=True):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_a_profiled_step_names_every_kernel(llm: LLM) -> None:
    _needs_op(llm)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([list(range(300, 320))], params, use_tqdm=False)
    names = {e.key for e in prof.key_averages()}
    assert {"servelab::planned_block_layers_bound", "servelab::block_linear", "servelab::paged_attention",
            "servelab::plan:linears", "servelab::plan:attention", "servelab::plan:mlp"} <= names  # fmt: skip


class _Phases(NullHooks):
    def __init__(self) -> None:
        self.names: list[str] = []

    def phase(self, name: str) -> Any:
        self.names.append(name)
        return super().phase(name)


@torch.inference_mode()
def test_observed_attention_keeps_the_loop(llm: LLM) -> None:
    """engine/hooks.observe_attention wraps each layer's attention call in a phase range: with hooks
    on, the op must not bypass it."""
    plan = _needs_op(llm)
    backend = plan.layers[0].attn.attn_backend
    hooks = _Phases()
    observe_attention(backend, hooks)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert backend.decode_rows() is None
    finally:
        observe_attention(backend, NULL_HOOKS)
    assert hooks.names.count("attention") == 4 * len(plan.layers)  # every step, every layer


def test_switched_off_by_the_config_and_its_variable(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels.forward_plan import _block_layers

    plan = _needs_op(llm)
    inner = _model(llm).model
    before = options.current()
    try:
        options.configure(dataclasses.replace(before, block_layers=False))
        assert _block_layers(plan.layers, inner) is None
        options.configure(dataclasses.replace(before, block_layers=True))
        assert _block_layers(plan.layers, inner) is not None
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
