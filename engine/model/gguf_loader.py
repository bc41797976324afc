"""Loading a llama.cpp GGUF file: hyper-parameters, dequantized weights, HF names.

Every tensor (Q4_0, Q4_1, Q5_*, Q8_0, K-quants, F16, BF16, F32, ...) is dequantized
with `gguf.quants.dequantize`, which already returns arrays in torch's row-major
[out_features, in_features] order, except the default model's two block types, Q4_1 and
Q8_0, which torch dequantizes here to the same float32 values (the same products and sums,
bit for bit) ~3x faster: 0.94 -> 0.35 s of every SmolLM2 load on two cores. llama.cpp's
converter permutes the rows of the Q and K projections of a Llama for its interleaved rotary
layout; we undo that permutation so the rotate-half RoPE of `engine/model/llama.py` applies (the
same reverse permutation HF transformers performs in its own GGUF loader). The Qwen and Phi-3
converters keep HF's order (llama.cpp rotates those with NEOX, rotate-half): the family says
which (`ModelFamily.gguf_rotary_permuted`, engine/model/registry.py).

Names: a tensor `blk.N.<kind>.weight|bias` becomes `model.layers.N.<HF name>.weight|bias`; the
kinds are Llama's, plus Qwen3's `attn_q_norm` / `attn_k_norm`, and for Phi-3 the fused
`attn_qkv` and `ffn_up` (gate and up in one), which fill the fused parameters as they are.
Gemma 3's four norms per layer have names of their own (`ffn_norm` is its pre-feedforward norm),
and llama.cpp's converter stored each norm weight plus one (its RMSNorm multiplies by the weight,
HF Gemma's by one plus it): the loader takes the one off again, as HF transformers' does, so a
GGUF and a HF folder fill the same parameters.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import numpy as np
import torch

from engine.model.arch import ModelArch
from engine.model.gguf_file import GGUF_MAGIC, GGUFFile
from engine.model.registry import family

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3: per-head RMSNorm weights [head_dim]
    "attn_k_norm": "self_attn.k_norm",
}
# Families whose GGUF files store fused projections: a kind's name there
_FAMILY_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# Families whose converter stored every `*norm.weight` plus this (HF's Gemma RMSNorm: x * (1 + weight))
_NORM_WEIGHT_OFFSET = {"gemma3": 1.0}
# Mixtral experts: llama.cpp stacks them ([E, out, in]) or, in older files, numbers them.
_EXPERT_NAMES = {"ffn_gate": "w1", "ffn_down": "w2", "ffn_up": "w3"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+?)(?:_exps|\.(\d+))?\.(weight|bias)$")
_IGNORED = {"rope_freqs.weight"}


def is_gguf_file(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """A `GGUFFile` over `path` (memory-mapped; engine/model/gguf_file.py); ValueError if it is
    not a GGUF file. Cached per (file, modification time): the loader, the architecture and
    the tokenizer share one parse."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"model: no such file {str(path)!r}")
    if not is_gguf_file(path):
        raise ValueError(f"model: {str(path)!r} is not a GGUF file (bad magic)")
    return _cached_reader(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def read_gguf_arch(path: str | Path) -> ModelArch:
    return ModelArch.from_gguf_metadata(open_gguf(path))


def unpermute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    Within each head llama.cpp orders the rows as interleaved pairs
    (r0, r_half, r1, r_half+1, ...); rotate-half RoPE wants the two halves in blocks.
    w: [n_head * head_dim, ...] -> same shape.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter permutation (the inverse of `unpermute_rotary_rows`)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_names(gguf_name: str, num_experts: int, family_name: str = "llama") -> list[tuple[str, int | None]]:
    """HF parameter names for one GGUF tensor of a `family_name` model, with the expert index each takes.

    A stacked-expert tensor maps to one name per expert (index = slice of dim 0);
    others map to one name with index None. Unknown names give [].
    """
    if gguf_name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[gguf_name], None)]
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        return []
    layer, kind, expert, suffix = m.group(1), m.group(2), m.group(3), m.group(4)
    prefix = f"model.layers.{layer}."
    stacked = gguf_name.endswith("_exps.weight")
    if stacked or expert is not None:
        if kind not in _EXPERT_NAMES or suffix != "weight":
            return []
        w = _EXPERT_NAMES[kind]
        experts = range(num_experts) if stacked else [int(expert)]
        return [(f"{prefix}block_sparse_moe.experts.{e}.{w}.weight", e if stacked else None) for e in experts]
    if suffix == "bias" and kind not in ("attn_q", "attn_k", "attn_v"):  # Qwen2's q/k/v biases only
        return []
    names = {**_LAYER_NAMES, **_FAMILY_LAYER_NAMES.get(family_name, {})}
    if kind not in names:
        return []
    return [(f"{prefix}{names[kind]}.{suffix}", None)]


def _dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks ([n, 34] bytes: a float16 scale d, 32 int8 q) -> [n, 32] float32 d * q."""
    d = raw[:, :2].contiguous().view(torch.float16).float()
    return raw[:, 2:].contiguous().view(torch.int8).float() * d


def _dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks ([n, 20] bytes: float16 scale d and minimum m, 16 bytes whose low nibbles are
    elements 0-15 and high nibbles 16-31) -> [n, 32] float32 d * q + m."""
    d = raw[:, :2].contiguous().view(torch.float16).float()
    m = raw[:, 2:4].contiguous().view(torch.float16).float()
    qs = raw[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
    return d * q + m


_TORCH_DEQUANTIZERS = {"Q8_0": (_dequantize_q8_0, 34), "Q4_1": (_dequantize_q4_1, 20)}
# The block types `load_gguf_blocks` gives as stored: (weights, bytes) per block, as gguf's
# GGML_QUANT_SIZES says (engine/kernels/cpu_blocks.py reads them all; the AVX-512 packs Q4_1 / Q8_0).
GGUF_BLOCK_SIZES = {"Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def _as_torch(array: np.ndarray) -> torch.Tensor:
    """`array` as a torch tensor; a copy where it views the file's read-only map (or is strided)."""
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).copy()
    return torch.from_numpy(array)


def dequantize_tensor(tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One GGUF tensor (`GGUFTensor`) -> a torch tensor of `dtype` in row-major (torch) shape:
    torch dequantizes the block types of _TORCH_DEQUANTIZERS, `gguf.quants.dequantize` the others."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    found = _TORCH_DEQUANTIZERS.get(getattr(tensor.tensor_type, "name", ""))
    if found is not None:
        fn, block_bytes = found
        values = fn(_as_torch(np.asarray(tensor.data).view(np.uint8)).reshape(-1, block_bytes))
    else:
        from gguf.quants import dequantize

        values = _as_torch(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
    return values.reshape(shape).to(dtype)


def load_gguf_state_dict(
    path: str | Path, arch: ModelArch | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """All weights of a GGUF file under HF Llama/Mixtral names, dequantized to `dtype`.

    Layers at or beyond `arch.num_layers` are skipped (so a truncated arch loads fast).
    Q/K projections are un-permuted where the family's converter permuted them (a Llama's).
    Tied models simply have no `lm_head.weight`.
    """
    reader = open_gguf(path)
    arch = arch or ModelArch.from_gguf_metadata(reader)
    permuted = family(arch.family).gguf_rotary_permuted
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        targets = hf_names(tensor.name, arch.num_experts, arch.family)
        if not targets:
            if tensor.name not in _IGNORED:
                logger.warning("GGUF tensor %s has no HF counterpart; skipped", tensor.name)
            continue
        if _layer_index(targets[0][0]) >= arch.num_layers:
            continue
        weight = dequantize_tensor(tensor, torch.float32)
        if arch.family in _NORM_WEIGHT_OFFSET and tensor.name.endswith("norm.weight"):
            weight = weight - _NORM_WEIGHT_OFFSET[arch.family]
        if permuted and ".attn_q." in tensor.name:
            weight = unpermute_rotary_rows(weight, arch.num_heads)
        elif permuted and ".attn_k." in tensor.name:
            weight = unpermute_rotary_rows(weight, arch.num_kv_heads)
        for name, expert in targets:
            state[name] = (weight if expert is None else weight[expert]).to(dtype).contiguous()
    return state


def load_gguf_blocks(path: str | Path, arch: ModelArch) -> dict[str, tuple[str, torch.Tensor]]:
    """The file's matrices of the block types in GGUF_BLOCK_SIZES as stored, for kernels that read them
    so (engine/kernels/cpu_blocks.py, amx_linear.py): HF name -> (block type, uint8 [rows,
    in_features / block weights, block bytes]: 32 weights a block, 256 for Q4_K / Q6_K), the rows in
    the order `load_gguf_state_dict` gives the weight (Q/K un-permuted).
    Expert tensors and layers beyond `arch.num_layers` are left out."""
    reader = open_gguf(path)
    permuted = family(arch.family).gguf_rotary_permuted
    blocks: dict[str, tuple[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        kind = getattr(tensor.tensor_type, "name", "")
        targets = hf_names(tensor.name, arch.num_experts, arch.family)
        if kind not in GGUF_BLOCK_SIZES or len(targets) != 1 or targets[0][1] is not None:
            continue
        name = targets[0][0]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        block_weights, block_bytes = GGUF_BLOCK_SIZES[kind]
        if _layer_index(name) >= arch.num_layers or len(shape) != 2 or shape[1] % block_weights:
            continue
        raw = _as_torch(np.asarray(tensor.data).view(np.uint8)).reshape(shape[0], shape[1] // block_weights, block_bytes)
        if permuted and ".attn_q." in tensor.name:
            raw = unpermute_rotary_rows(raw, arch.num_heads).contiguous()
        elif permuted and ".attn_k." in tensor.name:
            raw = unpermute_rotary_rows(raw, arch.num_kv_heads).contiguous()
        blocks[name] = (kind, raw)
    return blocks


def _layer_index(hf_name: str) -> int:
    """Layer number of an HF name, -1 for non-layer weights."""
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2])
    return -1


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> its type's name ("Q4_1", "Q8_0", "F32", ...), from the file's metadata."""
    return {t.name: getattr(t.tensor_type, "name", "") for t in open_gguf(path).tensors}


def gguf_layer_kinds(path: str | Path) -> list[str]:
    """The block kinds of the file's layer tensors (`blk.*`), the float ones left out, sorted."""
    types = gguf_tensor_types(path)
    return sorted({kind for name, kind in types.items() if name.startswith("blk.")} - {"F32", "F16", "BF16"})
