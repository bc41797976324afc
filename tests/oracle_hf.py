"""HF transformers on the same GGUF: the reference model and greedy tokens of the oracle tests."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch


@functools.cache
def _hf_float32(gguf: str) -> torch.nn.Module:
    """The GGUF through HF transformers in float32, loaded once per test session: transformers'
    GGUF reader takes ~20 s to parse this file (twice, config and weights), three modules need it."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
    path = Path(gguf)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def hf_model(gguf: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The HF reference model in `dtype`. Another dtype is a copy of the float32 model with its
    parameters cast, its buffers (the rotary inv_freq) kept in float32, as
    `from_pretrained(dtype=...)` leaves them: parameters, buffers and greedy tokens equal that
    model's (checked for bfloat16)."""
    base = _hf_float32(str(gguf))
    if dtype == torch.float32:
        return base
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.config.dtype = dtype
    return model


def hf_greedy_tokens(gguf: Path, prompt_ids: list[list[int]], dtype: torch.dtype, max_tokens: int) -> list[list[int]]:
    """Greedy continuations of `max_tokens` tokens (EOS not stopping) of each prompt, one at a time."""
    model = hf_model(gguf, dtype)
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=model.config.eos_token_id, eos_token_id=None,
            )
            outs.append(y[0, len(ids):].tolist())
    return outs
