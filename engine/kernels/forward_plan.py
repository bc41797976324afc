"""The planned CPU forward of a dense Llama model: the layers' eager forward with every weight
prepacked, as a flat list of op calls.

Same ops in the same order as the modules' forward (so the same numbers, bit for bit), without
~10 module calls and per-op eligibility checks per layer: at a decode step of SmolLM2 (30
layers, ~45 ms) that Python costs a few milliseconds. Per step it picks the linears' kernels by
row count: the AMX / AVX512-BF16 kernels up to `amx_linear.max_rows()` rows (`amx_max_rows`; each
call naming the next one's weight, so its threads prefetch it), the GEMV for a few float32 rows,
else oneDNN's prepacked kernels at padded row counts (`cpu_linear.padded_rows`). A
batch-invariant plan (`model.batch_invariant`) runs the decode kernels' bfloat16 packs at every
row count instead (engine/kernels/batch_invariance.py).

`LlamaModel.build_plan` makes one after the weights are packed; `LlamaModel.forward` runs it
for CPU inference in the plan's dtype; `on_huge_pages` moves the decode kernels' matrices into
one buffer of huge pages.

Under torch.profiler each part of a layer runs inside a `record_function` range named
`servelab::plan:<part>` (`PLAN_PARTS`: norm, linears, attention, mlp; the names of the module
groups servelab-explain reports for a model without a plan, workloads/explain_probe.py), as in
planned_layers.cpp's loop, so a profile of what runs says which part of the layers took the time.
Unprofiled, each part pays one `with` on a shared null context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from engine.hugepages import copies_on_huge_pages
from engine.kernels import amx_linear, block_layers, cpu_blocks, cpu_gemv
from engine.kernels.block_layers import BoundBlockLayers
from engine.kernels.cpu_kernels import kernels
from engine.kernels.cpu_linear import packed_linear, padded_rows
from engine.kernels.planned_layers import layers_op

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend, AttentionMetadata


# What the plan reads of a model: a dense decoder's modules by these names and attributes (the
# Llama family's, engine/model/llama.py; another family plans the same way by offering them).
# The kernels never import a model: these protocols are the whole of what they know of one.
class PlanAttention(Protocol):
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def qkv_proj(self) -> nn.Linear: ...
    @property
    def o_proj(self) -> nn.Linear: ...
    @property
    def attn_backend(self) -> AttentionBackend: ...


class PlanMLP(Protocol):
    @property
    def intermediate_size(self) -> int: ...
    @property
    def gate_up_proj(self) -> nn.Linear: ...
    @property
    def down_proj(self) -> nn.Linear: ...


class PlanNorm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def eps(self) -> float: ...


class PlanLayer(Protocol):
    @property
    def is_moe(self) -> bool: ...
    @property
    def self_attn(self) -> PlanAttention: ...
    @property
    def mlp(self) -> PlanMLP: ...
    @property
    def input_layernorm(self) -> PlanNorm: ...
    @property
    def post_attention_layernorm(self) -> PlanNorm: ...


class PlanModel(Protocol):
    @property
    def layers(self) -> nn.ModuleList: ...  # PlanLayer each
    @property
    def embed_tokens(self) -> nn.Embedding: ...
    @property
    def norm(self) -> PlanNorm: ...


class PlanRotary(Protocol):
    @property
    def cos_table(self) -> torch.Tensor: ...
    @property
    def sin_table(self) -> torch.Tensor: ...


# The profiler ranges of the planned layers' parts (module note); planned_layers.cpp names its own
# ranges the same. workloads/explain_probe.py keeps a copy of the prefix (tests/test_explain_stats.py).
PLAN_RANGE_PREFIX = "servelab::plan:"
PLAN_PARTS = ("norm", "linears", "attention", "mlp")
_NO_RANGES = (contextlib.nullcontext(),) * len(PLAN_PARTS)  # unprofiled: one shared null context per part


def part_ranges() -> tuple[contextlib.AbstractContextManager[Any], ...]:
    """A context per `PLAN_PARTS` entry, in that order: a `record_function` range while torch's
    profiler is on (each object entered again for every call of its part: they never nest), else
    shared null contexts (asked once per forward: ~0.1 us)."""
    if not torch.autograd._profiler_enabled():
        return _NO_RANGES
    return tuple(record_function(PLAN_RANGE_PREFIX + part) for part in PLAN_PARTS)


QuantPacks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
GgufBlock = tuple[str, torch.Tensor]  # (block type, uint8 [rows, in / 32, bytes]): gguf_loader.load_gguf_blocks
GgufBlocks = dict[str, GgufBlock]
LayerBlocks = tuple[GgufBlock | None, ...]  # a layer's qkv, o, gate_up, down (None: a matrix without blocks)


@dataclass(frozen=True, slots=True)
class AmxPacks:
    """A dense layer's matrices in the AMX kernels' layout (engine/kernels/amx_linear.py), for
    steps of at most `amx_linear.max_rows()` rows; gate_up packed for the fused silu * up.
    `quant`: the same four from the checkpoint's own blocks (amx_linear.quant_pack), for steps
    of at most `amx_linear.quant_max_rows` of each rows, where every one of them reproduces its weight."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    quant: QuantPacks | None = None

    def matrices(self, quant: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv, o, gate_up, down: the quant packs where asked for and present."""
        return self.quant if quant and self.quant is not None else (self.qkv, self.o, self.gate_up, self.down)


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One dense layer's tensors for the planned forward: norm weights and packed matrices."""

    attn: PlanAttention
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    amx: AmxPacks | None = None
    plain: tuple[torch.Tensor, ...] | None = None  # float32: row-major qkv, o, gate_up, down for the GEMV
    # the checkpoint's GGUF blocks of qkv, o, gate_up, down for cpu_blocks (AVX2 / scalar), where the
    # AVX-512 quant packs do not apply (engine/kernels/cpu_blocks.py)
    blocks: tuple[GgufBlock, ...] | None = None


_NO_PLAIN: tuple[None, None, None, None] = (None, None, None, None)  # a plan without the GEMV's weights


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """What the planned forward reads (module note)."""

    dtype: torch.dtype
    ops: Any  # torch.ops.servelab with the fused layer kernels
    eps: float
    layers: tuple[LayerPlan, ...]
    final_norm: torch.Tensor
    amx_ops: Any = None  # torch.ops.servelab with the AMX linear ops, where every layer has AMX packs
    sizes: tuple[int, int, int] = (0, 0, 0)  # qkv width, hidden size, intermediate size
    gemv_ops: Any = None  # torch.ops.servelab with the GEMV (cpu_gemv), for steps of a few rows
    quant_max_rows: int = 0  # every layer's AmxPacks has its quant packs: steps up to this many rows read them
    # model.batch_invariant: the decode kernels' bfloat16 packs at every step size, never the quant
    # packs, the GEMV or oneDNN (engine/kernels/batch_invariance.py)
    batch_invariant: bool = False
    amx_max_rows: int = 0  # steps up to this many rows run amx_ops (amx_linear.max_rows(), fixed at build)
    # planned_layers: the same layers in one C++ call for a step of decode rows only
    # (engine/kernels/planned_layers.py; build_plan sets it where `_layers_op` allows)
    layers_op: Any = None
    block_max_rows: int = 0  # every layer has `blocks`: steps up to this many rows read them (cpu_blocks)
    # block_layers: those steps' layers in one C++ call where every row decodes (engine/kernels/block_layers.py)
    block_layers: Any = None
    # What layers_op reads, flattened from `layers` at construction (so a plan made with other
    # layers, as on_huge_pages makes, never keeps the old tensors); empty where a layer has no packs.
    norms: tuple[torch.Tensor, ...] = field(init=False, default=())  # per layer: input, post-attention
    bf16_packs: tuple[torch.Tensor, ...] = field(init=False, default=())  # per layer: qkv, o, gate_up, down
    quant_packs: tuple[torch.Tensor, ...] = field(init=False, default=())  # the same, the quant packs (or none)
    layer_shape: tuple[int, ...] = field(init=False, default=())  # Hq, Hkv, head_dim, qkv width, hidden, intermediate

    def __post_init__(self) -> None:
        amx = [lp.amx for lp in self.layers]
        if not self.layers or any(packs is None for packs in amx):
            return
        a = self.layers[0].attn
        flat = {
            "norms": tuple(t for lp in self.layers for t in (lp.in_norm, lp.post_norm)),
            "bf16_packs": tuple(t for packs in amx if packs for t in packs.matrices(False)),
            "quant_packs": tuple(t for packs in amx if packs and packs.quant is not None for t in packs.quant),
            "layer_shape": (a.num_heads, a.num_kv_heads, a.head_dim, *self.sizes),
        }
        for name, value in flat.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    @property
    def quant(self) -> bool:
        return self.quant_max_rows > 0

    @property
    def onednn(self) -> bool:
        """The layers' dense linears run oneDNN's packed weights (at padded row counts); else `F.linear`
        on the plain ones, a plan made for the checkpoint's blocks where the float32 probe kept the BLAS."""
        return bool(self.layers[0].qkv.is_mkldnn)


def build_plan(model: PlanModel, blocks: Sequence[LayerBlocks | None] | None = None,
               batch_invariant: bool = False) -> ForwardPlan | None:  # fmt: skip
    """The plan of `model`'s forward where every layer is dense, its linears prepacked, and the
    fused kernels are built; None otherwise. `blocks`: per layer, the checkpoint's quantized
    qkv, o, gate_up and down matrices, fused as the weights are (the model finds them by its own
    names: LlamaForCausalLM.layer_blocks), for the decode kernels that read them as stored
    (ignored with `batch_invariant`)."""
    ops = kernels()
    layers = []
    inter = 0
    for index, module in enumerate(model.layers):
        layer = cast(PlanLayer, module)
        if layer.is_moe or ops is None:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        inter = mlp.intermediate_size
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if any(m.bias is not None for m in linears):
            return None
        # oneDNN's packed weights, or where the float32 probe kept the plain BLAS (cpu_linear.prepack_supported)
        # and the checkpoint's blocks are attached, the plain ones for F.linear (`ForwardPlan.onednn`)
        packed = [m.__dict__.get("packed_weight") for m in linears]
        if any(p is None for p in packed):
            if any(p is not None for p in packed) or not all("gguf_blocks" in m.__dict__ for m in linears):
                return None
            packed = [m.weight.detach() for m in linears]
        qkv, o, gate_up, down = (p for p in packed if p is not None)
        plain: tuple[torch.Tensor, ...] | None = tuple(m.weight.detach() for m in linears)
        if not all(cpu_gemv.max_rows(w.dtype) and w.is_contiguous() for w in plain or ()):
            plain = None
        gguf = tuple(cast("GgufBlock | None", m.__dict__.get("gguf_blocks")) for m in linears)  # cpu_blocks.attach
        layers.append(LayerPlan(attn, layer.input_layernorm.weight.detach(),
                                layer.post_attention_layernorm.weight.detach(), qkv, o, gate_up, down,
                                _amx_packs(attn, mlp, blocks[index] if blocks else None), plain,
                                tuple(g for g in gguf if g is not None) if all(g is not None for g in gguf) else None))  # fmt: skip
    if not layers or len({lp.qkv.is_mkldnn for lp in layers}) > 1:  # all on oneDNN's packs or none
        return None
    with_amx = all(lp.amx is not None for lp in layers)
    with_quant = with_amx and all(lp.amx is not None and lp.amx.quant is not None for lp in layers)
    if not with_amx:
        layers = [dataclasses.replace(lp, amx=None) for lp in layers]
    elif not with_quant:  # all layers or none
        layers = [dataclasses.replace(lp, amx=dataclasses.replace(lp.amx, quant=None)) if lp.amx else lp for lp in layers]
    first = layers[0].attn
    sizes = (first.q_size + 2 * first.kv_size, int(model.embed_tokens.weight.shape[1]), inter)
    with_gemv = all(lp.plain is not None for lp in layers)
    # steps up to this many rows read the quant packs (0: none left): the fewest any of them allows
    quant_rows = min((amx_linear.quant_max_rows(t) for lp in layers if lp.amx and lp.amx.quant for t in lp.amx.quant),
                     default=0)
    with_blocks = not with_quant and not batch_invariant and all(lp.blocks is not None for lp in layers)
    block_rows = min((cpu_blocks.max_rows(kind) for lp in layers for kind, _ in lp.blocks or ()), default=0)
    return ForwardPlan(model.embed_tokens.weight.dtype, ops, model.norm.eps, tuple(layers),
                       model.norm.weight.detach(), amx_linear.amx_ops() if with_amx else None, sizes,
                       cpu_gemv.gemv_ops() if with_gemv and not batch_invariant else None,
                       0 if batch_invariant else quant_rows, batch_invariant,
                       amx_linear.max_rows() if with_amx else 0,
                       _layers_op(layers) if with_amx and not batch_invariant else None,
                       block_rows if with_blocks else 0, _block_layers(layers, model) if with_blocks else None)  # fmt: skip


def _one_attention_shape(layers: Sequence[LayerPlan]) -> bool:
    """Whether every layer has the same attention shape and scale: what a one-call layer op takes."""
    return len({(lp.attn.num_heads, lp.attn.num_kv_heads, lp.attn.head_dim, lp.attn.scale) for lp in layers}) == 1


def _layers_op(layers: Sequence[LayerPlan]) -> Any | None:
    """planned_layers for these layers (every one with its decode kernels' packs), where they share
    one attention shape and scale and the op is built; None otherwise. Not for a batch-invariant
    plan: its attention takes another path."""
    return layers_op() if _one_attention_shape(layers) and all(lp.amx is not None for lp in layers) else None


def _block_layers(layers: Sequence[LayerPlan], model: PlanModel) -> BoundBlockLayers | None:
    """block_layers for these layers (every one with its four block matrices), where they share one
    attention shape and scale (block_layers.bind says what else it needs); None otherwise."""
    if not _one_attention_shape(layers):
        return None
    return block_layers.bind(layers, model.norm.weight.detach(), int(model.embed_tokens.weight.shape[1]),
                             model.norm.eps)  # fmt: skip


def _amx_packs(attn: PlanAttention, mlp: PlanMLP, blocks: LayerBlocks | None) -> AmxPacks | None:
    """The layer's matrices for the AMX kernels, or None where they do not apply (no AMX, not
    bfloat16, a shape they do not take); with the quant packs where `blocks` (qkv, o, gate_up,
    down, each fused as its weight is) reproduce every weight."""
    weights = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.down_proj.weight)
    inter = mlp.intermediate_size
    if not amx_linear.available() or not all(amx_linear.supports(w) for w in weights):
        return None
    if not amx_linear.supports(mlp.gate_up_proj.weight, inter):
        return None
    qkv, o, down = (amx_linear.pack(w) for w in weights)
    gate_up = amx_linear.pack(mlp.gate_up_proj.weight, inter)
    return AmxPacks(qkv, o, gate_up, down, _quant_packs(attn, mlp, blocks) if blocks is not None else None)


def _quant_packs(attn: PlanAttention, mlp: PlanMLP, blocks: LayerBlocks) -> QuantPacks | None:
    """The quant packs of (qkv, o, gate_up, down), or None as soon as one matrix has no blocks
    or its blocks do not reproduce its weight (the rest are then not packed: start-up time)."""
    full = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
    packs = []
    for i, (b, w) in enumerate(zip(blocks, full, strict=True)):
        packed = amx_linear.quant_pack(b[1], b[0], w, mlp.intermediate_size if i == 2 else 0) if b is not None else None
        if packed is None:
            return None
        packs.append(packed)
    return cast(QuantPacks, tuple(packs))


def planned_forward(
    plan: ForwardPlan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
) -> torch.Tensor:  # fmt: skip
    """The layers and the final norm on the embedded tokens x [T, H] -> [T, H]."""
    ops, eps = plan.ops, plan.eps
    t = x.shape[0]
    # up to amx_max_rows (every step, batch-invariant): AMX / AVX512-BF16 kernels
    amx = plan.amx_ops if t <= plan.amx_max_rows or plan.batch_invariant else None
    quant = amx is not None and t <= plan.quant_max_rows  # a few rows: the checkpoint's blocks
    gemv = plan.gemv_ops is not None and t <= cpu_gemv.max_rows(plan.dtype)  # a few rows: packed_linear's GEMV
    blocks = amx is None and t <= plan.block_max_rows  # a few rows: the checkpoint's blocks (cpu_blocks)
    # oneDNN's few shapes (cpu_linear.padded_rows)
    rows = t if amx is not None or gemv or blocks or not plan.onednn else padded_rows(t)
    if rows != t:  # zero rows stay zero through the layers (rms_norm of 0 is 0); attention skips them
        x = F.pad(x, (0, 0, 0, rows - t))
        cos, sin = F.pad(cos, (0, 0, 0, 0, 0, rows - t)), F.pad(sin, (0, 0, 0, 0, 0, rows - t))
    if blocks and plan.block_layers is not None:
        out = block_layers.step(plan, x, cos, sin, kv_caches, metadata)
        if out is not None:
            return out
    residual = x
    n_qkv, hidden, inter = plan.sizes
    last = len(plan.layers) - 1
    in_norm, in_linears, in_attention, in_mlp = part_ranges()  # profiler ranges (module note)
    for i, (lp, kv_cache) in enumerate(zip(plan.layers, kv_caches, strict=True)):
        with in_norm:
            if i == 0:
                x = ops.rms_norm(residual, lp.in_norm, eps)
            else:
                ops.add_rms_norm_(x, residual, lp.in_norm, eps)
        a = lp.attn
        hq, hkv = a.num_heads, a.num_kv_heads
        packs = lp.amx
        plain = lp.plain or _NO_PLAIN
        with in_linears:
            if amx is not None and packs is not None:
                # each call names the next one's weight: its threads prefetch their first blocks of it
                w_qkv, w_o, w_gate_up, w_down = packs.matrices(quant)
                qkv = amx.amx_linear(x, w_qkv, n_qkv, w_o).view(t, hq + 2 * hkv, a.head_dim)
            elif blocks and lp.blocks is not None:
                qkv = cpu_blocks.linear(x, lp.blocks[0][1], lp.blocks[0][0]).view(t, hq + 2 * hkv, a.head_dim)
            else:
                qkv = packed_linear(x, lp.qkv, plain=plain[0]).view(rows, hq + 2 * hkv, a.head_dim)
        with in_attention:
            ops.rope_(qkv, cos, sin, hq + hkv)
            q_rows = qkv[:t] if rows != t else qkv
            o = a.attn_backend.forward(q_rows[:, :hq], q_rows[:, hq : hq + hkv], q_rows[:, hq + hkv :], kv_cache,
                                       metadata, a.scale)  # fmt: skip
        if amx is not None and packs is not None:
            with in_linears:
                x = amx.amx_linear(o.reshape(t, a.q_size), w_o, hidden, w_gate_up)
            with in_norm:
                ops.add_rms_norm_(x, residual, lp.post_norm, eps)
            following = plan.layers[i + 1].amx if i < last else None  # the next layer's qkv comes next
            with in_linears:  # gate_up with the silu * up fused, then down
                x = amx.amx_linear(amx.amx_linear_silu_mul(x, w_gate_up, inter, w_down), w_down, hidden,
                                   following.matrices(quant)[0] if following is not None else None)
        elif blocks and lp.blocks is not None:
            (k_o, b_o), (k_gu, b_gu), (k_d, b_d) = lp.blocks[1:]
            with in_linears:
                x = cpu_blocks.linear(o.reshape(t, a.q_size), b_o, k_o)
            with in_norm:
                ops.add_rms_norm_(x, residual, lp.post_norm, eps)
            with in_linears:
                gate_up = cpu_blocks.linear(x, b_gu, k_gu)
            with in_mlp:
                x = ops.silu_mul(gate_up)
            with in_linears:
                x = cpu_blocks.linear(x, b_d, k_d)
        else:
            o = o.reshape(t, a.q_size)
            with in_linears:
                x = packed_linear(F.pad(o, (0, 0, 0, rows - t)) if rows != t else o, lp.o, plain=plain[1])
            with in_norm:
                ops.add_rms_norm_(x, residual, lp.post_norm, eps)
            with in_linears:
                gate_up = packed_linear(x, lp.gate_up, plain=plain[2])
            with in_mlp:
                x = ops.silu_mul(gate_up)
            with in_linears:
                x = packed_linear(x, lp.down, plain=plain[3])
    with in_norm:
        ops.add_rms_norm_(x, residual, plan.final_norm, eps)
    return x[:t] if rows != t else x


def planned_decode(
    plan: ForwardPlan, input_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
    rotary: PlanRotary, kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
    head: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """The embedding, the layers and the final norm of a step's tokens in one `layers_op` call
    (engine/kernels/planned_layers.py), where every row of the step is one decoding request that the
    decode kernels take (up to `amx_max_rows`) and the attention backend would make the op's
    attention calls (`AttentionBackend.decode_rows`); None otherwise (the caller embeds and runs
    `planned_forward`). Asked before the embedding: the op gathers the step's rows of it. With
    `head` (the LM head as `amx_linear_argmax` reads it, and its columns): the rows' greedy token
    ids instead of the norm's output (`LlamaForCausalLM.greedy_decode`)."""
    t = input_ids.shape[0]
    if plan.layers_op is None or plan.amx_ops is None or t > plan.amx_max_rows or embed.dtype != plan.dtype:
        return None
    first = plan.layers[0].attn
    rows = first.attn_backend.decode_rows()
    cache = kv_caches[0]
    if rows is None or cache.dtype != plan.dtype or not cache.is_contiguous() or rotary.cos_table.dtype != plan.dtype:
        return None
    quant = t <= plan.quant_max_rows  # a few rows: the checkpoint's blocks
    return plan.layers_op(input_ids, positions, embed, rotary.cos_table, rotary.sin_table, kv_caches,
                          metadata.slot_mapping, *rows, plan.norms, plan.quant_packs if quant else plan.bf16_packs,
                          plan.final_norm, plan.layer_shape, plan.eps, first.scale, head)  # fmt: skip


@torch.inference_mode()
def warm_up_linears(plan: ForwardPlan, max_rows: int) -> float:
    """Run each oneDNN linear of the plan once at every padded row count a step of up to
    `max_rows` tokens can have (`cpu_linear.padded_rows`), so that oneDNN has built all its
    primitives before the first request; returns the seconds taken."""
    t0 = time.perf_counter()
    lp = plan.layers[0]  # every layer has the same shapes
    hidden = plan.sizes[1]
    q_size = lp.attn.q_size
    low = plan.amx_max_rows + 1 if plan.amx_ops is not None else 1
    if plan.batch_invariant or not plan.onednn:  # no step runs oneDNN's linears
        return 0.0
    for rows in sorted({padded_rows(r) for r in range(low, max(max_rows, low) + 1)}):
        x = torch.zeros(rows, hidden, dtype=plan.dtype)
        packed_linear(x, lp.qkv)
        packed_linear(torch.zeros(rows, q_size, dtype=plan.dtype), lp.o)
        packed_linear(plan.ops.silu_mul(packed_linear(x, lp.gate_up)), lp.down)
    return time.perf_counter() - t0


def on_huge_pages(plan: ForwardPlan, heads: Sequence[torch.Tensor | None]) -> tuple[ForwardPlan, list[torch.Tensor | None]]:
    """The plan (and the packed LM heads, None kept) with the decode kernels' packed matrices,
    every layer's bfloat16 and quant packs and the heads, moved into one buffer of huge pages: a
    small-batch step streams all of them from memory, and with 4 KiB pages it pays a page walk
    every 4 KiB and the hardware prefetcher stops at each page's end. On a 2-core Zen 4
    (AVX512-BF16), SmolLM2's bfloat16 decode linears: 1.12x at 16 rows, 1.02-1.06x at 32-128,
    0.97x at 1 (benchmarks/decode_weight_pages.py, docs/benchmarks.md). On 2 Sapphire Rapids cores
    the quant packs' batch-1 step (Q4_1 layers, Q8_0 LM head) ran at about half the read bandwidth
    on 4 KiB pages: docs/benchmarks-log.md (2026-12-06). A plan with `amx_ops` set (every layer
    has its packs: build_plan)."""
    layers_in = [lp.amx for lp in plan.layers if lp.amx is not None]
    flat = [t for packs in layers_in for t in packs.matrices(False)]
    quant = [t for packs in layers_in if packs.quant is not None for t in packs.quant]
    kept = [h for h in heads if h is not None]
    moved = copies_on_huge_pages(flat + quant + kept)
    nf, nq = len(flat), len(quant)
    bf16_moved, quant_moved, heads_moved = moved[:nf], moved[nf : nf + nq], moved[nf + nq :]
    layers, bi, qi = [], 0, 0
    for lp in plan.layers:
        if lp.amx is None:
            layers.append(lp)
            continue
        q: QuantPacks | None = None
        if lp.amx.quant is not None:
            q = cast(QuantPacks, tuple(quant_moved[qi : qi + 4]))
            qi += 4
        qkv, o, gate_up, down = bf16_moved[bi : bi + 4]
        layers.append(dataclasses.replace(lp, amx=AmxPacks(qkv, o, gate_up, down, q)))
        bi += 4
    it = iter(heads_moved)
    return dataclasses.replace(plan, layers=tuple(layers)), [next(it) if h is not None else None for h in heads]
