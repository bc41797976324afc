"""Gemma 3 (text): the Llama model's frame around a layer of its own.

What differs from the Llama layer, each as HF transformers' `Gemma3ForCausalLM` computes it (the
oracle: tests/test_gemma3.py, greedy tokens equal on the same GGUF):
- the embedding is multiplied by sqrt(hidden), the factor rounded to the model's dtype first;
- every RMSNorm multiplies by (1 + weight), computed in float32 and rounded once (`GemmaRMSNorm`);
  a GGUF stores 1 + weight, which the loader takes off again (engine/model/gguf_loader.py);
- each query and key head is RMS-normed before the rotary (QK-norm, Qwen3's place);
- four norms per layer ("sandwich"): before and after the attention, before and after the MLP,
  the residual added after each post-norm;
- the MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x));
- local layers attend to the last `sliding_window` positions (their own included) with a rotary
  base of 10,000, global layers (every sixth, `ModelArch.layer_types`) to the whole context with
  the checkpoint's base (1e6) and its rope scaling; the attention scale is
  `query_pre_attn_scalar ** -0.5`;
- the LM head is the embedding (tied); logits are soft-capped where the config says so.

The sliding window goes to the attention backend per call (`AttentionBackend.forward`'s `window`;
the torch backend attends over just the last window's blocks). The layers form KV cache groups
(engine/kv_cache_spec.py: one of the global layers, the local ones in groups of as many): each layer
reads and writes through its group's metadata (`AttentionMetadata.for_group`), so a local layer's
blocks outside the window can be given back while the request runs.

The layer has no planned CPU forward (engine/kernels/forward_plan.py computes the Llama layer):
`LlamaModel.build_plan` finds it not `plannable` and the modules' forward runs. With
`model.quantized_decode` its linears read the checkpoint's blocks as stored at decode-sized steps
(engine/kernels/cpu_blocks.py: Q5_0 q / k / gate / up, Q8_0 or Q5_0 v, Q4_K o, Q6_K or Q4_K down, the
Q8_0 embedding as the LM head), on AVX2 or the scalar reference whatever the CPU: the AVX-512 quant
packs serve only the planned forward.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.kernels import cpu_blocks
from engine.kv_cache_spec import kv_cache_groups, layer_placement
from engine.model.arch import ModelArch
from engine.model.layers import GatedMLP, RotaryEmbedding, fused_ops, norm_heads_
from engine.model.llama import LlamaForCausalLM, LlamaModel


class GemmaRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + weight), in float32, rounded to x's dtype once (HF's Gemma3RMSNorm, op for op)."""

    # The weight that leaves x / rms(x) unscaled: random (dummy) weights fill norms with it (engine/model/dummy.py).
    identity_weight = 0.0

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            fused = fused_ops(x, self.weight)
            if fused is not None:  # one pass instead of ~8 ops: a decode step runs 6 norms a layer
                return fused.rms_norm(x, self._scale(), self.eps)  # type: ignore[no-any-return]
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def _scale(self) -> torch.Tensor:
        """1 + weight in float32, kept until the weight changes (a load writes it in place; its
        version counter moves). The fused norm multiplies x / rms(x) by it in float32, as above:
        in float32 storage that is this module's arithmetic with the sum of squares in another order.
        (bfloat16 storage keeps the ops above: the kernel would round 1 + weight to bfloat16.)"""
        key = (self.weight.data_ptr(), self.weight._version)
        if self.__dict__.get("_scale_key") != key:
            with torch.no_grad():
                self.__dict__["_scale_t"] = (1.0 + self.weight.detach().float()).contiguous()
            self.__dict__["_scale_key"] = key
        return self.__dict__["_scale_t"]  # type: ignore[no-any-return]


class Gemma3MLP(GatedMLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)); gate and up fused in one Linear as SwiGLU's are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # [T, H]


class Gemma3Attention(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.q_size
        self.scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.window = arch.window(layer)  # None: a global layer
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * arch.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.attn_backend = attn_backend

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D]: this layer's rotary (local or global)
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        t, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)
        # In place on qkv, as the Llama layer does: each query and key head normed over its D values,
        # then one rotary pass over them (the fused ops where they apply); q, k and v are views of qkv.
        norm_heads_(qkv, 0, hq, self.q_norm)
        norm_heads_(qkv, hq, hkv, self.k_norm)
        RotaryEmbedding.rotate_heads_(qkv, hq + hkv, cos, sin)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        o = self.attn_backend.forward(q, k, v, kv_cache, metadata, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    plannable = False  # forward_plan computes the Llama layer, not this one
    is_moe = False

    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(arch, attn_backend, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(h, arch.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """x: [T, H] the residual stream -> the same after this layer."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(LlamaModel):
    """LlamaModel's parts and plan interface (its plan is always None: no layer is `plannable`),
    Gemma's layers, norms and two rotaries: `rotary_emb` for the global layers, `rotary_local` for
    the sliding ones."""

    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, max_positions: int) -> None:
        nn.Module.__init__(self)  # (LlamaModel.__init__ would build Llama layers)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, attn_backend, i) for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)  # type: ignore[assignment]  # (1 + w), not w
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.rotary_local = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local_theta or arch.rope_theta)
        self.embed_scale = arch.hidden_size**0.5
        self.plan = None
        windows = [arch.window(i) for i in range(arch.num_layers)]
        self.kv_group = [g for g, _ in layer_placement(kv_cache_groups(windows), arch.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale).to(x.dtype)  # the factor rounded to the dtype first, as HF does
        rotaries = {False: self.rotary_emb.cos_sin(positions), True: self.rotary_local.cos_sin(positions)}
        for module, kv_cache, group in zip(self.layers, kv_caches, self.kv_group, strict=True):
            layer = cast(Gemma3DecoderLayer, module)
            cos, sin = rotaries[layer.self_attn.window is not None]
            x = layer(x, cos, sin, kv_cache, metadata.for_group(group))
        return self.norm(x)  # type: ignore[no-any-return]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model. The runner contract and the weight loading are LlamaForCausalLM's
    (q/k/v and gate/up fill fused parameters); the logits are soft-capped where the config says."""

    inner_model = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, upcast)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _block_reader(self, dtype: str) -> str:
        """cpu_blocks (module note) wherever it is built and takes `dtype`; "none" elsewhere."""
        return (cpu_blocks.isa() or "none") if dtype in ("float32", "bfloat16") else "none"

    def hf_weight_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.lm_head is not None:
            names.append("lm_head.weight")
        per_layer = [
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
            "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        ]  # fmt: skip
        return names + [f"model.layers.{i}.{p}.weight" for i in range(self.arch.num_layers) for p in per_layer]
