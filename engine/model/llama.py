"""The Llama model (and Mixtral when `arch.num_experts > 0`) over a paged KV cache; its decoder
layer also runs the other families of engine/model/registry.py through switches on `ModelArch`:
biases on q/k/v (`qkv_bias`, Qwen2), RMSNorm over each q and k head before the rotary
(`qk_norm`, Qwen3), top-k renormalisation (`norm_topk_prob`, Qwen3-MoE). The planned CPU forward
(forward_plan.py) computes the plain Llama layer only: a model with any of these switches runs
the modules' forward (`LlamaDecoderLayer.plannable`).

Contract with the model runner:
    hidden = model(input_ids [T] int64, positions [T] int64, kv_caches (one per layer),
                   attn_metadata)                      -> [T, hidden_size]
    logits = model.compute_logits(hidden[rows])        -> [N, vocab_size] float32
             (upcast=False: the model's dtype, for greedy-only sampling)
The model never calls `attn_backend.begin_step`: the runner does, once per step.
Weights come in under HF names through `load_weights`; Q/K/V and gate/up are stored
fused (one GEMM each), so the loader copies each HF tensor into its slice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.kernels import amx_linear, batch_invariance, cpu_blocks
from engine.kernels.cpu_kernels import kernels
from engine.kernels.cpu_linear import pack_weight, packed_linear, prepack_linears, prepack_supported
from engine.kernels.forward_plan import (
    ForwardPlan,
    GgufBlock,
    GgufBlocks,
    LayerBlocks,
    build_plan,
    on_huge_pages,
    planned_decode,
    planned_forward,
    warm_up_linears,
)
from engine.kernels.kernel_choices import block_linear_choice
from engine.model.arch import ModelArch
from engine.model.gguf_loader import load_gguf_blocks
from engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, norm_heads_
from engine.model.moe import MoEBlock

logger = logging.getLogger(__name__)

# Greedy from bfloat16 logits: the values within NEAR_MAX_REL of a row's maximum (two bfloat16
# steps, after rounding) are scored again in float32; the fused kernel lists up to
# NEAR_MAX_CANDIDATES of them per row (more, rarely: the torch path).
NEAR_MAX_REL = 2.0**-6
NEAR_MAX_CANDIDATES = 8


# A layer's fused linears (qkv, o, gate_up, down) as the checkpoint's HF-named matrices make them.
_FUSED_PARTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # fmt: skip
_FUSED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # (the same order)


def layer_blocks(blocks: GgufBlocks | None, index: int) -> LayerBlocks | None:
    """Layer `index`'s qkv, o, gate_up and down blocks, the fused ones concatenated as their
    weights are (None for a matrix whose parts are missing or of different block types)."""
    if not blocks:
        return None
    fused: list[GgufBlock | None] = []
    for parts in _FUSED_PARTS:
        found = [blocks.get(f"model.layers.{index}.{part}.weight") for part in parts]
        kinds = {b[0] for b in found if b is not None}
        if any(b is None for b in found) or len(kinds) != 1:
            fused.append(None)
            continue
        tensors = [b[1] for b in found if b is not None]
        fused.append((kinds.pop(), tensors[0] if len(tensors) == 1 else torch.cat(tensors)))
    return tuple(fused)


def layer_block_parts(blocks: GgufBlocks, index: int) -> tuple[list[GgufBlock] | None, ...]:
    """Layer `index`'s qkv, o, gate_up and down as the (block type, blocks) of their parts in row order
    (None for a matrix with a part missing): a fused matrix's parts may differ in type (Gemma 3's
    q / k in Q5_0, v in Q8_0), which cpu_blocks.attach_parts reads part by part."""
    out: list[list[GgufBlock] | None] = []
    for parts in _FUSED_PARTS:
        found = [blocks.get(f"model.layers.{index}.{part}.weight") for part in parts]
        out.append(None if any(b is None for b in found) else [b for b in found if b is not None])
    return tuple(out)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.attn_backend = attn_backend
        # Qwen3: each query and key head RMS-normed (weights [head_dim]) before the rotary
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            norm_heads_(qkv, 0, hq, self.q_norm)
            norm_heads_(qkv, hq, hkv, self.k_norm)
        # One in-place rotary pass over the query and key heads; q, k and v are strided views of qkv.
        RotaryEmbedding.rotate_heads_(qkv, hq + hkv, cos, sin)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # [T, Hq|Hkv|Hkv, D]
        o = self.attn_backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, attn_backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_moe = arch.is_moe
        # forward_plan.build_plan computes the plain dense layer: none of the other families' switches
        self.plannable = not (arch.is_moe or arch.qkv_bias or arch.qk_norm)
        if arch.is_moe:
            self.block_sparse_moe = MoEBlock(
                arch.hidden_size, arch.intermediate_size, arch.num_experts, arch.num_experts_per_tok,
                arch.norm_topk_prob,
            )
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual stream before it); residual None on layer 0."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm_(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, metadata)
        x, residual = self.post_attention_layernorm.add_norm_(x, residual)
        return (self.block_sparse_moe(x) if self.is_moe else self.mlp(x)), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, attn_backend) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.plan: ForwardPlan | None = None  # set by build_plan() once the weights are packed

    def build_plan(self, blocks: GgufBlocks | None = None, batch_invariant: bool = False) -> bool:
        """Plan the eager CPU forward (engine/kernels/forward_plan.py); returns whether a plan was made
        (never for a layer that is not `plannable`: the plan would skip its switches)."""
        plannable = all(getattr(layer, "plannable", False) for layer in self.layers)
        per_layer = [layer_blocks(blocks, i) for i in range(len(self.layers))] if blocks else None
        self.plan = build_plan(self, per_layer, batch_invariant) if plannable else None
        return self.plan is not None

    def warm_up_linears(self, max_rows: int) -> float:
        """Build oneDNN's kernels for every step size up to `max_rows` tokens before the first
        request (forward_plan.warm_up_linears); returns the seconds taken (0 without a plan)."""
        return 0.0 if self.plan is None else warm_up_linears(self.plan, max_rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = self.plan
        eager_cpu = (
            plan is not None and self.layers and input_ids.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )  # fmt: skip
        if eager_cpu and type(self.embed_tokens) is nn.Embedding:  # a vocab-parallel one holds a shard
            assert plan is not None
            out = planned_decode(plan, input_ids, positions, self.embed_tokens.weight, self.rotary_emb, kv_caches,
                                 metadata)  # fmt: skip
            if out is not None:
                return out
        x = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb.cos_sin(positions)  # [T, 1, D] each
        if eager_cpu and plan is not None and x.dtype == plan.dtype:
            return planned_forward(plan, x, cos, sin, kv_caches, metadata)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, metadata)
        if residual is None:  # no layers
            return self.norm(x)
        x, _ = self.norm.add_norm_(x, residual)
        return x


def _module_hooks(*modules: nn.Module) -> bool:
    """Whether a forward hook would run when any of `modules` is called (its own or a global one)."""
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks) or any(
        mod._forward_hooks or mod._forward_pre_hooks for mod in modules
    )


@dataclass(frozen=True)
class _GreedyPath:
    """What `LlamaForCausalLM.greedy_decode` reads of the model while a plan stands."""

    plan: ForwardPlan
    runs: bool  # the plan's decode path and the AMX head both exist (the plan exists only for a CPU model)
    embed: torch.Tensor
    rotary: RotaryEmbedding
    head: torch.Tensor | None  # the head amx_linear_argmax reads beyond quant_rows rows
    quant_head: torch.Tensor | None  # ... and up to them (the checkpoint's blocks)
    quant_rows: int
    vocab: int

    @staticmethod
    def of(model: LlamaForCausalLM, inner: LlamaModel, plan: ForwardPlan) -> _GreedyPath:
        runs = (
            model.amx_lm_head is not None and plan.amx_ops is not None and plan.dtype == torch.bfloat16
            and len(inner.layers) > 0 and type(inner.embed_tokens) is nn.Embedding
        )  # fmt: skip
        quant = model.quant_lm_head
        return _GreedyPath(plan, runs, inner.embed_tokens.weight, inner.rotary_emb, model.amx_lm_head, quant,
                           amx_linear.quant_max_rows(quant) if quant is not None else 0, model.arch.vocab_size)  # fmt: skip


# HF projection name -> (fused parameter name, shard index).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_EXPERT_SHARD = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


class LlamaForCausalLM(nn.Module):
    """Llama / Mixtral causal LM. See the module docstring for the runner contract."""

    inner_model: type[LlamaModel] = LlamaModel  # a family with layers of its own names its model (gemma3.py)

    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.model = self.inner_model(arch, attn_backend, max_positions or arch.max_position_embeddings)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.packed_lm_head: torch.Tensor | None = None  # set by prepack()
        self.amx_lm_head: torch.Tensor | None = None  # the LM head for the AMX kernels, set by prepack()
        self.quant_lm_head: torch.Tensor | None = None  # the same from the checkpoint's blocks (quant_pack)
        self.block_lm_head: GgufBlock | None = None  # the LM head's GGUF blocks, packed for cpu_blocks (prepack)
        self.gguf_path: Path | None = None  # the GGUF file the weights came from (loader.load_model)
        self.batch_invariant = False  # model.batch_invariant (loader.load_model; engine/kernels/batch_invariance.py)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def greedy_decode(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T] int64
        """`greedy_ids(forward(...))` for a step whose every row is a decoding request sampled
        greedily, in one call where both would take the decode kernels (the plan's layers op and the
        AMX LM head's fused argmax): the same ids, with no Python between the layers and the head and
        no second fork and join (`planned_decode` with `head`). None where either would not, or where
        module hooks are installed (they would see no module calls): the caller runs the two.
        Called every step, right after the weights have pushed everything else out of the caches: what
        does not change while the plan stands is looked up once per plan (`_GreedyPath`)."""
        m: LlamaModel = self._modules["model"]  # type: ignore[assignment]  # (no nn.Module.__getattr__ search)
        plan = m.plan
        if plan is None or torch.is_grad_enabled() or torch.compiler.is_compiling() or _module_hooks(self, m):
            return None
        path = self.__dict__.get("_greedy_path")
        if path is None or path.plan is not plan:
            path = self.__dict__["_greedy_path"] = _GreedyPath.of(self, m, plan)
        if not path.runs:
            return None
        head = path.quant_head if input_ids.shape[0] <= path.quant_rows else path.head
        assert head is not None  # (runs: the AMX head exists)
        return planned_decode(plan, input_ids, positions, path.embed, path.rotary, kv_caches, attn_metadata,
                              (head, path.vocab))  # fmt: skip

    def _lm_head_weight(self) -> torch.Tensor:
        """[vocab, H]: the LM head's weight, the embedding's where they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab], float32 (upcast=False: in the model's dtype, for a
        caller that only takes each row's argmax: no float32 copy of N x vocab values)."""
        weight = self._lm_head_weight()
        packed = self.packed_lm_head
        amx = self._amx_head(hidden)
        blocks = self.block_lm_head
        if amx is not None:
            logits = amx.amx_linear(hidden.contiguous(), self._head_pack(hidden), weight.shape[0])
        elif blocks is not None and hidden.device.type == "cpu" and cpu_blocks.takes(hidden, blocks[0]):
            logits = cpu_blocks.linear(hidden, blocks[1], blocks[0])
        elif packed is not None and hidden.dtype == weight.dtype and not torch.compiler.is_compiling():
            logits = packed_linear(hidden, packed, plain=weight)
        else:
            logits = F.linear(hidden, weight)
        return logits.float() if upcast else logits

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> [N] int64: the argmax of each row's logits, as
        `compute_logits(hidden, upcast=False).max(dim=-1).indices`, computed without storing the
        logits (the AMX LM head's fused argmax); from bfloat16 logits elsewhere on a CPU, with
        their near-ties settled in float32 (`_bf16_argmax`); None otherwise (the sampler's argmax)."""
        amx = self._amx_head(hidden)
        if amx is not None:
            return amx.amx_linear_argmax(hidden.contiguous(), self._head_pack(hidden), self.arch.vocab_size)
        if hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        return self._bf16_argmax(hidden)

    def _bf16_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy ids from bfloat16 logits, with the near-ties settled in float32.

        bfloat16 logits keep 8 significant bits: at a logit of 34 two tokens 0.2 apart round to
        the same value, and the first index wins the tie whatever the model meant. Every token
        within two bfloat16 steps of a row's maximum is scored again as a float32 dot product of
        the same bfloat16 hidden row and weight row (a few per row); the best of those wins (the
        first index among equals), as the AMX LM head's float32 argmax decides. The candidates
        come from the fused `near_max_rows` kernel where it is built (two passes over each row
        of logits, the second from cache), else from torch ops over all N x vocab values."""
        logits = self.compute_logits(hidden, upcast=False)
        ops = kernels()
        if ops is not None and logits.is_contiguous():
            first, count, cand = ops.near_max_rows(logits, NEAR_MAX_REL, NEAR_MAX_CANDIDATES)
            if bool((count <= 1).all()):  # one candidate per row (or a NaN maximum): the plain argmax
                return first
            if bool((count <= NEAR_MAX_CANDIDATES).all()):
                rows, slot = (cand >= 0).nonzero(as_tuple=True)
                keep = count[rows] > 1  # rows with one candidate keep `first`
                return self._settle_near_ties(hidden, first, rows[keep], cand[rows[keep], slot[keep]])
        top, first = logits.max(dim=-1)  # first: the plain argmax, kept where no row competes (NaN)
        top = top.float()
        floor = (top - top.abs() * NEAR_MAX_REL).to(logits.dtype)  # <= two steps below, after rounding
        rows, cols = (logits >= floor[:, None]).nonzero(as_tuple=True)
        if rows.numel() == logits.shape[0] and torch.equal(rows, torch.arange(rows.numel())):
            return cols  # one candidate per row: the plain argmax
        return self._settle_near_ties(hidden, first, rows, cols)

    def _settle_near_ties(self, hidden: torch.Tensor, first: torch.Tensor, rows: torch.Tensor,
                          cols: torch.Tensor) -> torch.Tensor:
        """`first` [N], with each row that has candidates (rows[i], cols[i]) given the candidate of
        the highest float32 score (the first index among equals)."""
        weight = self._lm_head_weight()
        scores = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
        best = torch.full(first.shape, float("-inf"), dtype=scores.dtype, device=first.device).scatter_reduce(0, rows, scores, "amax")
        win = scores == best[rows]
        return first.scatter_reduce(0, rows[win], cols[win], "amin", include_self=False)

    def _head_pack(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head the AMX ops read (after `_amx_head`): from the checkpoint's blocks for a
        step of a few rows where the model has them."""
        if self.quant_lm_head is not None and hidden.shape[0] <= amx_linear.quant_max_rows(self.quant_lm_head):
            return self.quant_lm_head
        return self.amx_lm_head

    def _amx_head(self, hidden: torch.Tensor) -> Any | None:
        plan = self.model.plan
        if (
            self.amx_lm_head is None or plan is None or plan.amx_ops is None or hidden.dtype != torch.bfloat16
            or (hidden.shape[0] > plan.amx_max_rows and not plan.batch_invariant)
            or hidden.device.type != "cpu" or torch.compiler.is_compiling()
        ):  # fmt: skip
            return None
        return plan.amx_ops

    def prepack(self, quantized_decode: bool = True) -> int:
        """Prepack the linear weights and the LM head for oneDNN where that applies
        (engine/kernels/cpu_linear.py), and for the decode kernels (amx_linear; with
        `quantized_decode`, also from the GGUF checkpoint's own blocks, unless `batch_invariant`:
        the AVX-512 quant packs where they run, else cpu_blocks on AVX2 or its scalar reference);
        returns how many matrices were packed for oneDNN."""
        n = prepack_linears(self)
        reader = self._block_reader(str(self._lm_head_weight().dtype).removeprefix("torch."))
        blocks = self._gguf_blocks(reader) if quantized_decode and not self.batch_invariant else None
        avx512_blocks = blocks is not None and reader == "avx512-vnni"
        avx2_blocks = None if avx512_blocks else blocks  # what cpu_blocks reads (AVX2 or scalar)
        if avx2_blocks is not None:
            self._attach_blocks(avx2_blocks)
        # the plan also where the float32 probe kept the BLAS (n == 0): its decode steps read the blocks
        if n or avx2_blocks is not None:
            self.model.build_plan(blocks if avx512_blocks else None, self.batch_invariant)
        if self.lm_head is not None:  # an untied LM head is one of the linears just packed
            self.packed_lm_head = self.lm_head.__dict__.get("packed_weight")
        elif n and prepack_supported(self.model.embed_tokens.weight):
            self.packed_lm_head = pack_weight(self.model.embed_tokens.weight)  # the tied head: a matrix of its own
            n += 1
        head = self._lm_head_weight()
        plan = self.model.plan
        if plan is not None and plan.amx_ops is not None and amx_linear.supports(head):
            self.amx_lm_head = amx_linear.pack(head)
            found = (blocks or {}).get(self._lm_head_name())
            if found is not None and plan.layers[0].amx is not None and plan.layers[0].amx.quant is not None:
                self.quant_lm_head = amx_linear.quant_pack(found[1], found[0], head)
        if plan is not None and plan.amx_ops is not None:  # forward_plan.on_huge_pages: why
            self.model.plan, (self.amx_lm_head, self.quant_lm_head) = on_huge_pages(
                plan, [self.amx_lm_head, self.quant_lm_head])
        if self.batch_invariant:
            batch_invariance.check_plan(self)
        batch_invariance.log_step_weights(self)
        return n

    def _lm_head_name(self) -> str:
        return "lm_head.weight" if self.lm_head is not None else "model.embed_tokens.weight"

    def _attach_blocks(self, blocks: GgufBlocks) -> None:
        """The dense layers' linears and the LM head read the checkpoint's blocks at decode-sized
        steps (cpu_blocks: AVX2, or the scalar reference); a layer whose matrices are not all in
        block kinds it reads keeps its dense weights."""
        for index, layer in enumerate(self.model.layers):
            if getattr(layer, "is_moe", True):  # (a dense layer of any family: qkv, o, gate_up, down)
                continue
            found = layer_block_parts(blocks, index)
            linears = tuple(cast(nn.Linear, layer.get_submodule(name)) for name in _FUSED_LINEARS)
            if not all(p is not None and cpu_blocks.attach_parts(m, p) for m, p in zip(linears, found, strict=True)):
                for m in linears:
                    cpu_blocks.detach(m)
        head = blocks.get(self._lm_head_name())
        weight = self._lm_head_weight()
        if head is not None and cpu_blocks.describes(head[0], head[1], weight.shape[0], weight.shape[1]):
            self.block_lm_head = (head[0], cpu_blocks.pack(head[1], head[0]))

    def step_weights(self) -> dict[str, str]:
        """Which weights the linears multiply, by step size (batch_invariance.step_weights)."""
        return batch_invariance.step_weights(self)

    def _block_reader(self, dtype: str) -> str:
        """What reads the checkpoint's blocks in `dtype` here (kernel_choices.block_linear_choice)."""
        return block_linear_choice(dtype)

    def _gguf_blocks(self, reader: str) -> GgufBlocks | None:
        """The checkpoint's block matrices for the decode kernels that read them, where they can
        apply: a GGUF file, weights on the CPU and a kernel here that reads them in their dtype
        (`reader`: kernel_choices.block_linear_choice)."""
        if self.gguf_path is None or self._lm_head_weight().device.type != "cpu" or reader == "none":
            return None
        return load_gguf_blocks(self.gguf_path, self.arch)

    # ---- weights -----------------------------------------------------------------
    def hf_weight_names(self) -> list[str]:
        """Every HF-named tensor `load_weights` needs for this architecture."""
        a = self.arch
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not a.tie_word_embeddings:
            names.append("lm_head.weight")
        per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.o_proj"]
        per_layer += [k for k in _FUSED if not (a.is_moe and k.startswith("mlp."))]
        if a.qk_norm:
            per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
        if a.is_moe:
            per_layer.append("block_sparse_moe.gate")
            per_layer += [f"block_sparse_moe.experts.{e}.{w}" for e in range(a.num_experts) for w in _EXPERT_SHARD]
        else:
            per_layer.append("mlp.down_proj")
        names += [f"model.layers.{i}.{p}.weight" for i in range(a.num_layers) for p in per_layer]
        if a.qkv_bias:
            names += [f"model.layers.{i}.self_attn.{p}.bias" for i in range(a.num_layers) for p in ("q_proj", "k_proj", "v_proj")]
        return names

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the (fused) parameters.

        Ignores `lm_head.weight` when embeddings are tied and rotary `inv_freq` buffers.
        ValueError on an unknown name, a shape mismatch, or a missing weight.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in state_dict.items():
            name = self.own_name(hf_name)
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            dest = self._destination(name, params)
            if dest.shape != tensor.shape:
                raise ValueError(f"model: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name)
        missing = [n for n in self.hf_weight_names() if n not in loaded]
        if missing:
            raise ValueError(f"model: {len(missing)} weights missing, e.g. {missing[:3]}")
        self._column_major_linears()

    def own_name(self, name: str) -> str:
        """The name a checkpoint's tensor goes by in `hf_weight_names` (a family whose checkpoints
        name some tensors otherwise maps them here: engine/model/qwen.py)."""
        return name

    def _column_major_linears(self) -> None:
        """On a CPU in float32, store each Linear weight [N, K] as the transpose of a contiguous [K, N] tensor.

        Same shape and values; `F.linear` then multiplies by a plain row-major [K, N] matrix,
        which the CPU BLAS runs ~5-30% faster than the transposed operand at these sizes in
        float32. In bfloat16 (oneDNN's kernels) the plain [N, K] layout was as fast or faster at
        every SmolLM2 shape, batch 64 (benchmarks/cpu_decode_step.py, avx512_bf16), so it stays.
        """
        for module in self.modules():
            w = module.weight if isinstance(module, nn.Linear) else None
            if w is not None and w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous():
                module.weight.data = w.data.t().contiguous().t()

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
        """The parameter (or slice of a fused one) that HF weight `name` fills."""
        if name in params:
            return params[name].data
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            raise ValueError(f"model: unexpected weight {name}")
        prefix, rest = ".".join(parts[:3]), ".".join(parts[3:-1])
        if rest in _FUSED:
            fused, shard = _FUSED[rest]
            param = params.get(f"{prefix}.{fused}.{parts[-1]}")  # .weight, or .bias (Qwen2's q/k/v)
            if param is not None:
                return param.data.narrow(0, *self._shard_range(fused, shard))
        if rest.startswith("block_sparse_moe.experts.") and parts[-2] in _EXPERT_SHARD:
            stacked, half = _EXPERT_SHARD[parts[-2]]
            param = params.get(f"{prefix}.block_sparse_moe.{stacked}")
            if param is not None:
                expert = param.data[int(parts[5])]
                size = self.arch.intermediate_size
                return expert if half is None else expert.narrow(0, half * size, size)
        raise ValueError(f"model: unexpected weight {name}")

    def _shard_range(self, fused: str, shard: int) -> tuple[int, int]:
        """(start row, row count) of one shard in a fused weight."""
        a = self.arch
        if fused == "mlp.gate_up_proj":
            return shard * a.intermediate_size, a.intermediate_size
        starts = (0, a.q_size, a.q_size + a.kv_size)
        return starts[shard], a.q_size if shard == 0 else a.kv_size
