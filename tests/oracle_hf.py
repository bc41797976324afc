"""HF transformers on the same GGUF: the reference greedy tokens of the oracle tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def hf_greedy_tokens(gguf: Path, prompt_ids: list[list[int]], dtype: torch.dtype, max_tokens: int) -> list[list[int]]:
    """Greedy continuations of `max_tokens` tokens (EOS not stopping) of each prompt, one at a time."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    model.eval()
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
