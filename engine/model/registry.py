"""Which model class runs which architecture: the model registry (vLLM's, in small).

A checkpoint names its architecture: a Hugging Face `config.json` in `architectures` (e.g.
"Qwen2ForCausalLM"; a model shape may give only `model_type`), a GGUF file in
`general.architecture` (e.g. "qwen2"). `family_of_hf` / `family_of_gguf` map that name to a
`ModelFamily`; any other name is a ValueError listing the supported ones. A family's differences
from the Llama layer are switches on `ModelArch` (biases on q/k/v, q/k RMSNorm per head, top-k
renormalisation), set here once per family, so every family shares `engine/model/llama.py`'s
decoder layer; each family's class (one file per family) holds what its checkpoints name
differently. Gemma 3 (engine/model/gemma3.py) has a layer of its own, built of the same parts.

This module imports neither torch nor the model classes: the simulator and the planner resolve
architectures without building a model. `model_class` imports the family's module when the
loader builds one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family: the names checkpoints call it by and how its layers differ."""

    name: str  # ModelArch.family
    module: str  # the module holding the model class
    class_name: str
    hf_architectures: tuple[str, ...]  # config.json `architectures`
    model_types: tuple[str, ...]  # config.json `model_type` (model shapes name only this)
    gguf_architectures: tuple[str, ...]  # GGUF `general.architecture`
    qkv_bias: bool = False  # biases on the q, k and v projections (not o): Qwen2
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary: Qwen3
    # Mixture of experts: whether the top-k routing weights are renormalised to sum to one when the
    # config does not say (`norm_topk_prob`); Mixtral always does, HF's Qwen3-MoE default is no.
    norm_topk_default: bool = True
    # llama.cpp's converter permutes the Q / K rows of this family for its interleaved rotary
    # (its Llama converter only; the Qwen and Phi-3 ones keep HF's order, llama.cpp's NEOX rope)
    gguf_rotary_permuted: bool = False
    # engine/model/parallel_layers.py shards this family's parameters (the Llama / Mixtral ones)
    tensor_parallel: bool = False
    # the MLP's activation (HF `hidden_act` / `hidden_activation`): SwiGLU's silu, Gemma's tanh GELU
    hidden_act: str = "silu"


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", "engine.model.llama", "LlamaForCausalLM",
                ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"), ("llama", "mistral", "mixtral"),
                ("llama",), gguf_rotary_permuted=True, tensor_parallel=True),
    ModelFamily("qwen2", "engine.model.qwen", "Qwen2ForCausalLM", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",),
                qkv_bias=True),
    ModelFamily("qwen3", "engine.model.qwen", "Qwen3ForCausalLM", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",),
                qk_norm=True),
    ModelFamily("qwen3_moe", "engine.model.qwen", "Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
                ("qwen3moe",), qk_norm=True, norm_topk_default=False),
    ModelFamily("phi3", "engine.model.phi3", "Phi3ForCausalLM", ("Phi3ForCausalLM",), ("phi3",), ("phi3",)),
    ModelFamily("gemma3", "engine.model.gemma3", "Gemma3ForCausalLM", ("Gemma3ForCausalLM",), ("gemma3_text",),
                ("gemma3",), qk_norm=True, hidden_act="gelu_pytorch_tanh"),
)  # fmt: skip

_BY_NAME = {f.name: f for f in FAMILIES}


def supported() -> str:
    """The supported architecture names, as an error message lists them."""
    hf = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    gguf = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    return f"config.json architectures: {hf}; GGUF general.architecture: {gguf}"


def family(name: str) -> ModelFamily:
    """The family named `name` (`ModelArch.family`); ValueError for an unknown one."""
    found = _BY_NAME.get(name)
    if found is None:
        raise ValueError(f"model: no model family {name!r} (families: {', '.join(_BY_NAME)})")
    return found


def family_of_hf(cfg: Mapping[str, Any]) -> ModelFamily:
    """The family of a HF `config.json` dict (or a model shape): by its first `architectures`
    entry, else its `model_type`; a dict with neither is a Llama (the first model shapes named
    none). ValueError naming the architecture and the supported list for any other."""
    archs = cfg.get("architectures") or []
    if archs:
        name = str(archs[0])
        found = next((f for f in FAMILIES if name in f.hf_architectures), None)
    else:
        name = str(cfg.get("model_type") or "llama")
        found = next((f for f in FAMILIES if name in f.model_types), None)
    if found is None:
        raise ValueError(f"model: architecture {name!r} is not supported ({supported()})")
    return found


def family_of_gguf(architecture: str) -> ModelFamily:
    """The family of a GGUF file's `general.architecture`; ValueError naming it and the supported list."""
    found = next((f for f in FAMILIES if architecture in f.gguf_architectures), None)
    if found is None:
        raise ValueError(f"model: GGUF architecture {architecture!r} is not supported ({supported()})")
    return found


def model_class(name: str) -> type:
    """The model class of family `name` (imported here, on first use)."""
    fam = family(name)
    return getattr(importlib.import_module(fam.module), fam.class_name)  # type: ignore[no-any-return]
