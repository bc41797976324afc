"""Phi-3 (mini / medium at 4k context): the Llama decoder layer, its checkpoints fused.

A Phi-3 checkpoint stores the q, k and v projections as one `self_attn.qkv_proj.weight`
([(Hq + 2 Hkv) * D, H], q rows first) and the gate and up projections as one
`mlp.gate_up_proj.weight` ([2 I, H], gate rows first): the very layout and names of the Llama
layer's fused parameters here, so they load as they are (a GGUF file's `attn_qkv` / fused `ffn_up`
too: engine/model/gguf_loader.py). Its rotary is rotate-half over whole heads; a config with a
partial rotary or LongRoPE scaling (the 128k variants) is refused by `ModelArch.from_hf_config`.
"""

from __future__ import annotations

from engine.model.llama import LlamaForCausalLM

# Llama's separate projections -> the fused tensor a Phi-3 checkpoint holds instead (None: inside it)
_FUSED_IN_CHECKPOINT = {
    "self_attn.q_proj": "self_attn.qkv_proj",
    "self_attn.k_proj": None,
    "self_attn.v_proj": None,
    "mlp.gate_proj": "mlp.gate_up_proj",
    "mlp.up_proj": None,
}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: the Llama layer; the checkpoint's fused projections fill the fused parameters."""

    def hf_weight_names(self) -> list[str]:
        names = []
        for name in super().hf_weight_names():
            parts = name.split(".")
            proj = ".".join(parts[3:-1]) if len(parts) > 4 else ""
            if proj not in _FUSED_IN_CHECKPOINT:
                names.append(name)
            elif (fused := _FUSED_IN_CHECKPOINT[proj]) is not None:
                names.append(".".join([*parts[:3], fused, parts[-1]]))
        return names
