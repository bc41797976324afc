"""The Llama model (and Mixtral when `arch.num_experts > 0`) over a paged KV cache.

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

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.hugepages import copies_on_huge_pages
from engine.model import amx_linear, cpu_gemv
from engine.model.arch import ModelArch
from engine.model.cpu_kernels import kernels
from engine.model.cpu_linear import (
    pack_weight,
    packed_linear,
    padded_rows,
    prepack_linears,
    prepack_supported,
)
from engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from engine.model.moe import MoEBlock

# Greedy from bfloat16 logits: the values within NEAR_MAX_REL of a row's maximum (two bfloat16
# steps, after rounding) are scored again in float32; the fused kernel lists up to
# NEAR_MAX_CANDIDATES of them per row (more, rarely: the torch path).
NEAR_MAX_REL = 2.0**-6
NEAR_MAX_CANDIDATES = 8


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.attn_backend = attn_backend

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
        if arch.is_moe:
            self.block_sparse_moe = MoEBlock(
                arch.hidden_size, arch.intermediate_size, arch.num_experts, arch.num_experts_per_tok
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


@dataclass(frozen=True, slots=True)
class _AmxPacks:
    """A dense layer's matrices in the AMX kernels' layout (engine/model/amx_linear.py), for
    steps of at most `amx_linear.DECODE_MAX_ROWS` rows; gate_up packed for the fused silu * up."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True, slots=True)
class _LayerPlan:
    """One dense layer's tensors for the planned forward: norm weights and packed matrices."""

    attn: LlamaAttention
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    amx: _AmxPacks | None = None
    plain: tuple[torch.Tensor, ...] | None = None  # float32: row-major qkv, o, gate_up, down for the GEMV


_NO_PLAIN: tuple[None, None, None, None] = (None, None, None, None)  # a plan without the GEMV's weights


@dataclass(frozen=True, slots=True)
class _ForwardPlan:
    """The eager CPU forward with every weight prepacked, as a flat list of op calls.

    Same ops in the same order as the modules' forward (so the same numbers, bit for bit),
    without ~10 module calls and per-op eligibility checks per layer: at a decode step of
    SmolLM2 (30 layers, ~45 ms) that Python costs a few milliseconds.
    """

    dtype: torch.dtype
    ops: Any  # torch.ops.servelab with the fused layer kernels
    eps: float
    layers: tuple[_LayerPlan, ...]
    final_norm: torch.Tensor
    amx_ops: Any = None  # torch.ops.servelab with the AMX linear ops, where every layer has AMX packs
    sizes: tuple[int, int, int] = (0, 0, 0)  # qkv width, hidden size, intermediate size
    gemv_ops: Any = None  # torch.ops.servelab with the GEMV (cpu_gemv), for steps of a few rows


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, attn_backend) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta)
        self.plan: _ForwardPlan | None = None  # set by build_plan() once the weights are packed

    def build_plan(self) -> bool:
        """Plan the eager forward where every layer is dense, its linears prepacked, and the
        fused kernels are built; returns whether a plan was made."""
        ops = kernels()
        layers = []
        inter = 0
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            if layer.is_moe or ops is None:
                return False
            attn, mlp = layer.self_attn, layer.mlp
            inter = mlp.intermediate_size
            linears: list[nn.Linear] = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            packed = [m.__dict__.get("packed_weight") for m in linears]
            if any(p is None for p in packed) or any(m.bias is not None for m in linears):
                return False
            qkv, o, gate_up, down = (p for p in packed if p is not None)
            plain: tuple[torch.Tensor, ...] | None = tuple(m.weight.detach() for m in linears)
            if not all(cpu_gemv.max_rows(w.dtype) and w.is_contiguous() for w in plain or ()):
                plain = None
            layers.append(_LayerPlan(attn, layer.input_layernorm.weight.detach(),
                                     layer.post_attention_layernorm.weight.detach(), qkv, o, gate_up, down,
                                     _amx_packs(attn, mlp), plain))  # fmt: skip
        if not layers:
            return False
        with_amx = all(lp.amx is not None for lp in layers)
        if not with_amx:
            layers = [dataclasses.replace(lp, amx=None) for lp in layers]
        first = layers[0].attn
        sizes = (first.q_size + 2 * first.kv_size, int(self.embed_tokens.weight.shape[1]), inter)
        with_gemv = all(lp.plain is not None for lp in layers)
        self.plan = _ForwardPlan(self.embed_tokens.weight.dtype, ops, self.norm.eps, tuple(layers),
                                 self.norm.weight.detach(), amx_linear.amx_ops() if with_amx else None, sizes,
                                 cpu_gemv.gemv_ops() if with_gemv else None)  # fmt: skip
        return True

    def _planned_forward(
        self, plan: _ForwardPlan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        ops, eps = plan.ops, plan.eps
        t = x.shape[0]
        amx = plan.amx_ops if t <= amx_linear.DECODE_MAX_ROWS else None  # decode-sized steps: AMX kernels
        gemv = plan.gemv_ops is not None and t <= cpu_gemv.max_rows(plan.dtype)  # a few rows: packed_linear's GEMV
        rows = t if amx is not None or gemv else padded_rows(t)  # oneDNN's few shapes (cpu_linear.padded_rows)
        if rows != t:  # zero rows stay zero through the layers (rms_norm of 0 is 0); attention skips them
            x = F.pad(x, (0, 0, 0, rows - t))
            cos, sin = F.pad(cos, (0, 0, 0, 0, 0, rows - t)), F.pad(sin, (0, 0, 0, 0, 0, rows - t))
        residual = x
        n_qkv, hidden, inter = plan.sizes
        last = len(plan.layers) - 1
        for i, (lp, kv_cache) in enumerate(zip(plan.layers, kv_caches, strict=True)):
            if i == 0:
                x = ops.rms_norm(residual, lp.in_norm, eps)
            else:
                ops.add_rms_norm_(x, residual, lp.in_norm, eps)
            a = lp.attn
            hq, hkv = a.num_heads, a.num_kv_heads
            packs = lp.amx
            plain = lp.plain or _NO_PLAIN
            if amx is not None and packs is not None:
                # each call names the next one's weight: its threads prefetch their first blocks of it
                qkv = amx.amx_linear(x, packs.qkv, n_qkv, packs.o).view(t, hq + 2 * hkv, a.head_dim)
            else:
                qkv = packed_linear(x, lp.qkv, plain=plain[0]).view(rows, hq + 2 * hkv, a.head_dim)
            ops.rope_(qkv, cos, sin, hq + hkv)
            q_rows = qkv[:t] if rows != t else qkv
            o = a.attn_backend.forward(q_rows[:, :hq], q_rows[:, hq : hq + hkv], q_rows[:, hq + hkv :], kv_cache,
                                       metadata, a.scale)  # fmt: skip
            if amx is not None and packs is not None:
                x = amx.amx_linear(o.reshape(t, a.q_size), packs.o, hidden, packs.gate_up)
                ops.add_rms_norm_(x, residual, lp.post_norm, eps)
                following = plan.layers[i + 1].amx if i < last else None  # the next layer's qkv comes next
                x = amx.amx_linear(amx.amx_linear_silu_mul(x, packs.gate_up, inter, packs.down), packs.down, hidden,
                                   following and following.qkv)
            else:
                o = o.reshape(t, a.q_size)
                x = packed_linear(F.pad(o, (0, 0, 0, rows - t)) if rows != t else o, lp.o, plain=plain[1])
                ops.add_rms_norm_(x, residual, lp.post_norm, eps)
                x = packed_linear(ops.silu_mul(packed_linear(x, lp.gate_up, plain=plain[2])), lp.down, plain=plain[3])
        ops.add_rms_norm_(x, residual, plan.final_norm, eps)
        return x[:t] if rows != t else x

    @torch.inference_mode()
    def warm_up_linears(self, max_rows: int) -> float:
        """Run each oneDNN linear of the planned forward once at every padded row count a step of
        up to `max_rows` tokens can have (`cpu_linear.padded_rows`), so that oneDNN has built all
        its primitives before the first request; returns the seconds taken (0 without a plan)."""
        plan = self.plan
        if plan is None:
            return 0.0
        t0 = time.perf_counter()
        lp = plan.layers[0]  # every layer has the same shapes
        n_qkv, hidden, inter = plan.sizes
        q_size = lp.attn.q_size
        low = amx_linear.DECODE_MAX_ROWS + 1 if plan.amx_ops is not None else 1
        for rows in sorted({padded_rows(r) for r in range(low, max(max_rows, low) + 1)}):
            x = torch.zeros(rows, hidden, dtype=plan.dtype)
            packed_linear(x, lp.qkv)
            packed_linear(torch.zeros(rows, q_size, dtype=plan.dtype), lp.o)
            packed_linear(plan.ops.silu_mul(packed_linear(x, lp.gate_up)), lp.down)
        return time.perf_counter() - t0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb.cos_sin(positions)  # [T, 1, D] each
        plan = self.plan
        if (
            plan is not None and self.layers and x.dtype == plan.dtype and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        ):
            return self._planned_forward(plan, x, cos, sin, kv_caches, metadata)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, metadata)
        if residual is None:  # no layers
            return self.norm(x)
        x, _ = self.norm.add_norm_(x, residual)
        return x


def _amx_packs(attn: LlamaAttention, mlp: GatedMLP) -> _AmxPacks | None:
    """The layer's matrices for the AMX kernels, or None where they do not apply (no AMX, not
    bfloat16, a shape they do not take)."""
    weights = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.down_proj.weight)
    inter = mlp.intermediate_size
    if not amx_linear.available() or not all(amx_linear.supports(w) for w in weights):
        return None
    if not amx_linear.supports(mlp.gate_up_proj.weight, inter):
        return None
    qkv, o, down = (amx_linear.pack(w) for w in weights)
    return _AmxPacks(qkv, o, amx_linear.pack(mlp.gate_up_proj.weight, inter), down)


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

    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, attn_backend, max_positions or arch.max_position_embeddings)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.packed_lm_head: torch.Tensor | None = None  # set by prepack()
        self.amx_lm_head: torch.Tensor | None = None  # the LM head for the AMX kernels, set by prepack()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def _lm_head_weight(self) -> torch.Tensor:
        """[vocab, H]: the LM head's weight, the embedding's where they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab], float32 (upcast=False: in the model's dtype, for a
        caller that only takes each row's argmax: no float32 copy of N x vocab values)."""
        weight = self._lm_head_weight()
        packed = self.packed_lm_head
        amx = self._amx_head(hidden)
        if amx is not None:
            logits = amx.amx_linear(hidden.contiguous(), self.amx_lm_head, weight.shape[0])
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
            return amx.amx_linear_argmax(hidden.contiguous(), self.amx_lm_head, self.arch.vocab_size)
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

    def _amx_head(self, hidden: torch.Tensor) -> Any | None:
        plan = self.model.plan
        if (
            self.amx_lm_head is None or plan is None or plan.amx_ops is None or hidden.dtype != torch.bfloat16
            or hidden.shape[0] > amx_linear.DECODE_MAX_ROWS or hidden.device.type != "cpu" or torch.compiler.is_compiling()
        ):  # fmt: skip
            return None
        return plan.amx_ops

    def prepack(self) -> int:
        """Prepack the linear weights and the LM head for oneDNN where that applies
        (engine/model/cpu_linear.py); returns how many matrices were packed."""
        n = prepack_linears(self)
        if n:
            self.model.build_plan()
        if self.lm_head is not None:  # an untied LM head is one of the linears just packed
            self.packed_lm_head = self.lm_head.__dict__.get("packed_weight")
        elif n and prepack_supported(self.model.embed_tokens.weight):
            self.packed_lm_head = pack_weight(self.model.embed_tokens.weight)  # the tied head: a matrix of its own
            n += 1
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        plan = self.model.plan
        if plan is not None and plan.amx_ops is not None and amx_linear.supports(head):
            self.amx_lm_head = amx_linear.pack(head)
        if plan is not None and plan.amx_ops is not None:
            self._decode_weights_on_huge_pages(plan)
        return n

    def _decode_weights_on_huge_pages(self, plan: _ForwardPlan) -> None:
        """Move the decode kernels' packed matrices (every layer's and the LM head's) into one
        buffer of huge pages: a small-batch step streams all of them from memory, and with 4 KiB
        pages it pays a page walk every 4 KiB. On a 2-core Zen 4 (AVX512-BF16), SmolLM2's decode
        linears: 1.12x at 16 rows, 1.02-1.06x at 32-128, 0.97x at 1 (benchmarks/decode_weight_pages.py,
        docs/benchmarks.md)."""
        # plan.amx_ops is set only where every layer has its packs (build_plan)
        flat = [t for lp in plan.layers if lp.amx is not None for t in (lp.amx.qkv, lp.amx.o, lp.amx.gate_up, lp.amx.down)]
        head = [self.amx_lm_head] if self.amx_lm_head is not None else []
        moved = copies_on_huge_pages(flat + head)
        layers = tuple(
            dataclasses.replace(lp, amx=_AmxPacks(*moved[4 * i : 4 * i + 4])) for i, lp in enumerate(plan.layers)
        )
        self.model.plan = dataclasses.replace(plan, layers=layers)
        if head:
            self.amx_lm_head = moved[-1]

    # ---- weights -----------------------------------------------------------------
    def hf_weight_names(self) -> list[str]:
        """Every HF-named tensor `load_weights` needs for this architecture."""
        a = self.arch
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not a.tie_word_embeddings:
            names.append("lm_head.weight")
        per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.o_proj"]
        per_layer += [k for k in _FUSED if not (a.is_moe and k.startswith("mlp."))]
        if a.is_moe:
            per_layer.append("block_sparse_moe.gate")
            per_layer += [f"block_sparse_moe.experts.{e}.{w}" for e in range(a.num_experts) for w in _EXPERT_SHARD]
        else:
            per_layer.append("mlp.down_proj")
        names += [f"model.layers.{i}.{p}.weight" for i in range(a.num_layers) for p in per_layer]
        return names

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the (fused) parameters.

        Ignores `lm_head.weight` when embeddings are tied and rotary `inv_freq` buffers.
        ValueError on an unknown name, a shape mismatch, or a missing weight.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in state_dict.items():
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
            param = params.get(f"{prefix}.{fused}.weight")
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
