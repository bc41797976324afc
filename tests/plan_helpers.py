"""What the tests of the one-call layer ops share (tests/test_planned_layers.py: `layers_op`,
tests/test_block_layers.py: `block_layers`): an engine's model, both sides of a plan's op on the same
prompts, and hooks that list the phases they were asked for."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.frontend.llm import LLM
from engine.hooks import NullHooks
from engine.sampling_params import SamplingParams


def model_of(llm: LLM) -> Any:
    """The in-process engine's model (LlamaForCausalLM)."""
    return llm.engine_core.executor.worker.model  # type: ignore[attr-defined]


def run_with_and_without(llm: LLM, field: str, prompts: list[list[int]],
                         max_tokens: int) -> tuple[list[Any], list[list[torch.Tensor]], int]:  # fmt: skip
    """Greedy tokens and every step's hidden states with the plan's op `field` (`layers_op`,
    `block_layers`) and without it (the Python loop), and how many steps the op ran. Every step goes
    through the model's forward, whose output is recorded, not the greedy one-call path."""
    inner = model_of(llm).model
    plan = inner.plan
    op = getattr(plan, field)
    calls = [0]

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return op(*args)

    forward = inner.forward
    hidden: list[list[torch.Tensor]] = [[], []]
    tokens = []
    side = [0]  # 0: with the op, 1: without

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        hidden[side[0]].append(out.clone())
        return out

    inner.forward = recording
    model_of(llm).greedy_decode = lambda *args: None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        for side[0], p in enumerate((dataclasses.replace(plan, **{field: counting}),
                                     dataclasses.replace(plan, **{field: None}))):  # fmt: skip
            inner.plan = p
            llm.reset_prefix_cache()
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    finally:
        inner.forward, inner.plan = forward, plan
        del model_of(llm).greedy_decode
    return tokens, hidden, calls[0]


class PhaseNames(NullHooks):
    """Hooks that record the name of every phase range asked for."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def phase(self, name: str) -> Any:
        self.names.append(name)
        return super().phase(name)
