"""The packaged long-context shape (Llama-3.1-8B) and its llama3 rope scaling (issue 36, item 2).

The scaled frequencies are checked against a float64 transcription of Meta's reference
`apply_scaling` (one frequency at a time, in plain Python) and, where transformers is installed,
against its own llama3 rope initialisation. The full 8B shape is built on the meta device (no
memory); a copy of it narrowed to a tiny width, with the same context and scaling, runs in the
engine with dummy weights at positions past the 8,192 of pre-training.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from engine.config import ModelConfig
from engine.model.layers import RotaryEmbedding
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import read_shape, resolve_model
from engine.model.rope_scaling import RopeScaling
from engine.model.source import SHAPES_DIR
from engine.sampling_params import SamplingParams

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # fmt: skip


def reference_inv_freq(head_dim: int, theta: float, cfg: dict) -> list[float]:
    """Meta's llama3 `apply_scaling`, in float64, one frequency at a time."""
    old_len, factor = cfg["original_max_position_embeddings"], cfg["factor"]
    low, high = cfg["low_freq_factor"], cfg["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_llama3_scaling_matches_the_float64_reference() -> None:
    scaling = RopeScaling.from_hf(LLAMA31)
    assert scaling is not None
    theta, head_dim = 500000.0, 128
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ref = torch.tensor(reference_inv_freq(head_dim, theta, LLAMA31), dtype=torch.float64)
    got = scaling.scale(base)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0.0)
    # All three regimes occur at this shape: kept, blended, divided.
    assert (got == base).any() and (got == base / 8).any() and ((got != base) & (got != base / 8)).any()
    # The engine's float32 table: same frequencies to float32 precision.
    rot = RotaryEmbedding(head_dim, 4096, theta, scaling)
    pos = torch.tensor([1, 1000, 4095], dtype=torch.float64)
    want = torch.cos(pos[:, None] * ref[None, :])
    torch.testing.assert_close(rot.cos_table[pos.long(), : head_dim // 2].double(), want, atol=2e-3, rtol=0)


def test_llama3_scaling_matches_transformers() -> None:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils", reason="transformers is not installed")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=131072, rope_scaling=dict(LLAMA31))  # fmt: skip
    inv_freq, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = RotaryEmbedding(128, 8, 500000.0, RopeScaling.from_hf(LLAMA31))
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    torch.testing.assert_close(ours.scaling.scale(base), inv_freq.float(), rtol=1e-6, atol=0.0)  # type: ignore[union-attr]


def test_unknown_rope_scaling_is_refused_not_ignored() -> None:
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="lacks low_freq_factor"):
        RopeScaling.from_hf({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})  # fmt: skip


def test_llama31_shape_is_llama3_8b_with_a_long_context() -> None:
    arch, weights_fn, _ = resolve_model(ModelConfig(model="llama-3.1-8b", num_layers_override=1))
    short = read_shape(SHAPES_DIR / "llama-3-8b.yaml")
    assert weights_fn is None and arch.num_layers == 1
    assert arch.max_position_embeddings == 131072 and short.max_position_embeddings == 8192
    assert arch.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert read_shape(SHAPES_DIR / "llama-3.1-8b.yaml").num_parameters() == short.num_parameters()
    assert arch.max_model_len(131072) == 131072
    with torch.device("meta"):  # the 8B shape itself: no memory
        model = LlamaForCausalLM(arch, None)  # type: ignore[arg-type]
    assert model.model.rotary_emb.scaling == arch.rope_scaling
    assert model.model.rotary_emb.max_positions == 131072


def test_llama31_scaled_rope_runs_past_8192_with_dummy_weights(tmp_path: Path) -> None:
    """The packaged shape at a tiny width and two layers: same context, same scaling."""
    from engine.frontend.llm import LLM

    cfg = yaml.safe_load((SHAPES_DIR / "llama-3.1-8b.yaml").read_text())
    cfg.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               intermediate_size=48, vocab_size=64)  # fmt: skip
    shape = tmp_path / "llama-3.1-8b-tiny.yaml"
    shape.write_text(yaml.safe_dump(cfg))
    llm = LLM(model=str(shape), dtype="float32", max_model_len=8448, num_blocks=544, block_size=16, max_num_seqs=1,
              max_num_batched_tokens=4096, enable_prefix_caching=False)  # fmt: skip
    assert llm.engine_core.max_model_len == 8448
    prompt = {"prompt_token_ids": [3 + i % 60 for i in range(8300)]}
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
