"""The decoder layers in one C++ call (engine/kernels/planned_layers.py) against the planned
forward's Python loop: the same hidden states bit for bit on every decode step, with the
bfloat16 packs (dummy weights) and the checkpoint's quant packs (the real SmolLM2 GGUF; both as
the team step and op by op, at 1 and 3 rows); steps with prefill rows and observed attention keep
the loop, and a profiled step calls every kernel by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from plan_helpers import PhaseNames, model_of, run_with_and_without

from engine.frontend.llm import LLM
from engine.hooks import NULL_HOOKS, observe_attention
from engine.sampling_params import SamplingParams


def _needs_op(llm: LLM) -> Any:
    plan = model_of(llm).model.plan
    if plan is None or plan.layers_op is None:
        pytest.skip("planned_layers needs the decode kernels (a CPU with AMX or AVX512-BF16) and a C++ toolchain")
    return plan


@torch.inference_mode()
def test_op_equals_the_python_loop_with_bfloat16_packs() -> None:
    llm = LLM(model="smollm2", load_format="dummy", num_layers_override=3, dtype="bfloat16", num_blocks=64,
              max_num_seqs=3, max_num_batched_tokens=32)  # fmt: skip
    _needs_op(llm)
    prompts = [list(range(100, 140)), [7, 8, 9] * 7, [5, 6]]  # chunked prefill, mixed steps, then 1-3 decode rows
    tokens, hidden, calls = run_with_and_without(llm, "layers_op", prompts, 6)
    assert tokens[0] == tokens[1]
    assert len(hidden[0]) == len(hidden[1]) > 5
    for a, b in zip(hidden[0], hidden[1], strict=True):
        assert torch.equal(a, b)
    # decode-only steps ran the op; the steps with prefill rows (at least the first two) did not
    assert 3 <= calls <= len(hidden[0]) - 2


def _team_step_count() -> int:
    return int(torch.ops.servelab.decode_team_steps())


@pytest.mark.parametrize("team", [True, False], ids=["team", "dispatcher"])
@pytest.mark.parametrize("rows", [1, 3])
@torch.inference_mode()
def test_op_equals_the_python_loop_with_the_checkpoints_quant_packs(team: bool, rows: int) -> None:
    """Both ways the op runs the quant packs: the team step (one parallel region for the layers,
    where the CPU has AVX512-VNNI) and the ops called one by one through the dispatcher; 1 and 3
    decode rows (the attention's units split into context segments differently)."""
    llm = LLM(model="smollm2", max_num_seqs=rows, max_model_len=512)
    plan = _needs_op(llm)
    if not plan.quant_packs:
        pytest.skip("no quant packs: the CPU lacks AVX512-BF16 for the GGUF block kernels")
    had = torch.ops.servelab.set_decode_team(None)
    if team and not had:
        pytest.skip("the team step needs the GGUF block kernels' AVX512-VNNI build (engine/kernels/csrc/gguf_blocks.h)")
    torch.ops.servelab.set_decode_team(team)
    before = _team_step_count()
    try:
        prompts = [list(range(200 + 40 * i, 232 + 40 * i + 5 * i)) for i in range(rows)]
        tokens, hidden, calls = run_with_and_without(llm, "layers_op", prompts, 8)
    finally:
        torch.ops.servelab.set_decode_team(had)
    assert tokens[0] == tokens[1]
    assert calls == 7  # every step after the prompts' (one prefill step: the prompts fit one budget)
    assert _team_step_count() - before == (calls if team else 0)
    for a, b in zip(hidden[0], hidden[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("team", [True, False], ids=["team", "dispatcher"])
@pytest.mark.parametrize("rows", [1, 3])
@torch.inference_mode()
def test_greedy_decode_equals_the_forward_and_the_heads_argmax(team: bool, rows: int) -> None:
    """`LlamaForCausalLM.greedy_decode` (the layers and the LM head's argmax in one call, in the team
    step's region where it runs) gives at every greedy decode step the ids that the forward and
    `greedy_ids` give apart, and the runner takes it on every decode step."""
    llm = LLM(model="smollm2", max_num_seqs=rows, max_model_len=512)
    plan = _needs_op(llm)
    model = model_of(llm)
    if not plan.quant_packs or model.quant_lm_head is None:
        pytest.skip("no quant packs: the CPU lacks AVX512-BF16 for the GGUF block kernels")
    had = torch.ops.servelab.set_decode_team(None)
    if team and not had:
        pytest.skip("the team step needs the GGUF block kernels' AVX512-VNNI build (engine/kernels/csrc/gguf_blocks.h)")
    fused = model.greedy_decode
    checked = [0]

    def checking(*args: Any) -> torch.Tensor | None:
        ids = fused(*args)
        if ids is not None:  # the same step again, apart (its cache write repeats the same values)
            assert torch.equal(ids, model.greedy_ids(model.forward(*args)))
            checked[0] += 1
        return ids

    torch.ops.servelab.set_decode_team(team)
    model.greedy_decode = checking
    before = _team_step_count()
    try:
        prompts = [list(range(300 + 40 * i, 332 + 40 * i + 5 * i)) for i in range(rows)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.ops.servelab.set_decode_team(had)
        del model.greedy_decode
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert checked[0] == 7  # every step after the prompts' one prefill step
    # the team step ran each fused call and each forward beside it
    assert _team_step_count() - before == (2 * checked[0] if team else 0)


@torch.inference_mode()
def test_a_profiled_step_keeps_every_kernel_in_view() -> None:
    """Under torch.profiler the op calls each kernel through the dispatcher (the profile lists them
    by name), not the team step."""
    llm = LLM(model="smollm2", max_num_seqs=1, max_model_len=512)
    plan = _needs_op(llm)
    if not plan.quant_packs or not torch.ops.servelab.set_decode_team(None):
        pytest.skip("the team step needs the GGUF block kernels' AVX512-VNNI build (engine/kernels/csrc/gguf_blocks.h)")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    before = _team_step_count()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([list(range(300, 320))], params, use_tqdm=False)
    names = {e.key for e in prof.key_averages()}
    # a greedy step's one call (the layers and the head's argmax), each kernel in it by name
    assert {"servelab::planned_greedy_bound", "servelab::amx_linear", "servelab::amx_linear_argmax"} <= names
    assert _team_step_count() == before
    llm.generate([list(range(300, 320))], params, use_tqdm=False)
    assert _team_step_count() - before == 3  # unprofiled: the team step


@torch.inference_mode()
def test_observed_attention_and_batch_invariant_plans_keep_the_loop() -> None:
    """engine/hooks.observe_attention wraps each layer's attention call in a phase range: with
    hooks on, the op must not bypass it; a batch-invariant plan has no op at all."""
    llm = LLM(model="smollm2", load_format="dummy", num_layers_override=2, dtype="bfloat16", num_blocks=32,
              max_num_seqs=1)  # fmt: skip
    plan = _needs_op(llm)
    backend = plan.layers[0].attn.attn_backend
    hooks = PhaseNames()
    observe_attention(backend, hooks)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert backend.decode_rows() is None
    finally:
        observe_attention(backend, NULL_HOOKS)
    assert hooks.names.count("attention") == 4 * 2  # every step, every layer: no step took the op
    invariant = LLM(model="smollm2", load_format="dummy", num_layers_override=2, dtype="bfloat16", num_blocks=32,
                    max_num_seqs=1, batch_invariant=True)  # fmt: skip
    assert model_of(invariant).model.plan.layers_op is None


def test_op_rejects_mismatched_lists_and_ids_outside_the_tables() -> None:
    from engine.kernels.planned_layers import layers_op

    op = layers_op()
    if op is None:
        pytest.skip("planned_layers needs the decode kernels (a CPU with AMX or AVX512-BF16) and a C++ toolchain")
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    table = torch.zeros(8, 64, dtype=torch.bfloat16)  # embedding and rotary tables
    cache = torch.zeros(2, 4, 16, 1, 64, dtype=torch.bfloat16)
    ids = torch.zeros(1, dtype=torch.int64)

    def call(token: int, position: int, norms: list[torch.Tensor]) -> None:
        op(ids + token, ids + position, table, table, table, [cache], ids, ids.view(1, 1), torch.tensor([0, 1]),
           ids + 1, norms, [x], x, [1, 1, 64, 192, 64, 64], 1e-5, 0.125)  # fmt: skip

    with pytest.raises(RuntimeError, match="2 norms and 4 packed matrices per KV cache"):
        call(0, 0, [x])
    with pytest.raises(RuntimeError, match="input_ids: 8 is outside 0 .. 7"):
        call(8, 0, [x, x])
    with pytest.raises(RuntimeError, match="positions: -1 is outside 0 .. 7"):
        call(0, -1, [x, x])
