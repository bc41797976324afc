"""The Qwen families: Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE, on the Llama decoder layer.

Their layers differ from Llama's by switches that `ModelArch` carries (engine/model/registry.py
sets them per family) and `engine/model/llama.py` computes: Qwen2 adds biases to the q, k and v
projections (`qkv_bias`); Qwen3 drops them and RMS-norms each query and key head over its
head_dim values before the rotary (`qk_norm`, weights `self_attn.q_norm` / `k_norm` [head_dim]);
Qwen3-MoE is Qwen3's attention over Mixtral's routed SwiGLU experts (engine/model/moe.py), the
top-k weights renormalised only where the config's `norm_topk_prob` says so. Both Qwen families
rotate with rotate-half (llama.cpp's NEOX), and their GGUF files keep HF's Q/K row order.

What is left here is what Qwen checkpoints name otherwise: Qwen3-MoE's router and experts.
"""

from __future__ import annotations

import re

from engine.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 (`arch.qkv_bias`): HF names as Llama's, plus `self_attn.{q,k,v}_proj.bias`."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (`arch.qk_norm`): HF names as Llama's, plus `self_attn.q_norm.weight` / `k_norm.weight`."""


# Qwen3-MoE's HF names under `model.layers.N.` -> the Mixtral names of LlamaDecoderLayer's MoEBlock
_QWEN3_MOE_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_QWEN3_MOE_SHARD = {"gate": "w1", "up": "w3", "down": "w2"}
_QWEN3_MOE_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention, every layer's MLP a routed mixture of experts. Its checkpoints
    name the router `mlp.gate` and the experts `mlp.experts.E.{gate,up,down}_proj`; they load into
    Mixtral's `block_sparse_moe.gate` / `experts.E.{w1,w3,w2}` (a GGUF file's experts come in under
    those names already: engine/model/gguf_loader.py)."""

    def own_name(self, name: str) -> str:
        expert = _QWEN3_MOE_EXPERT.match(name)
        if expert is not None:
            prefix, index, proj = expert.groups()
            return f"{prefix}.block_sparse_moe.experts.{index}.{_QWEN3_MOE_SHARD[proj]}.weight"
        router = _QWEN3_MOE_ROUTER.match(name)
        if router is not None:
            return f"{router.group(1)}.block_sparse_moe.gate.weight"
        return name
