"""The kernels an engine chose at start-up, in words, for the logs and for a benchmark's rounds.

Some choices follow the CPU's flags (bfloat16 linears on AMX or AVX512-BF16), some a timing probe
at each process's start that machine noise can tip (float32 linears: oneDNN prepacked or the plain
BLAS, `cpu_linear.onednn_float32_faster`; `dtype: auto` on avx512_bf16 without AMX). The engine core
reports them once it is ready (`ReadyInfo.choices`), the front end logs them as one line, and
benchmarks/round_conditions.py reads that line to name a round that ran other kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kernels import amx_linear, cpu_blocks
from engine.kernels.cpu_linear import float32_linear_kernel
from engine.kernels.isa import AVX2_BLOCK_FLAGS, cpu_flags, kernel_cpu_flags
from engine.platform import resolve_device, resolve_engine_dtype

LOG_PREFIX = "engine start-up choices: "


def block_linear_choice(dtype: str) -> str:
    """What reads a GGUF checkpoint's blocks at decode-sized steps in `dtype` here: "avx512-vnni"
    (amx_linear's quant packs, bfloat16), "avx2" or "scalar" (cpu_blocks), "none"."""
    if dtype == "bfloat16" and amx_linear.quant_available():
        return "avx512-vnni"
    if dtype not in ("float32", "bfloat16"):
        return "none"
    return cpu_blocks.isa() or "none"


def quantized_decode_fallback(model: object, quantized_decode: bool, batch_invariant: bool,
                              layer_kinds: Callable[[Any], list[str]]) -> str | None:  # fmt: skip
    """After `prepack`: the warning to log where `model.quantized_decode` asked for the checkpoint's
    blocks and a step will not read them (or reads them only at one row), naming the option, what
    this CPU or checkpoint lacks and what runs instead; None where it was honoured or does not apply
    (not a GGUF file, switched off, `batch_invariant`, which documents that it reads no blocks).
    `layer_kinds(path)`: the block kinds of the checkpoint's layer matrices (asked only when needed;
    engine/model/gguf_loader.py's `gguf_layer_kinds`)."""
    gguf = getattr(model, "gguf_path", None)
    step_weights = getattr(model, "step_weights", None)
    if not quantized_decode or batch_invariant or gguf is None or step_weights is None:
        return None
    weights = step_weights()
    dtype = str(model._lm_head_weight().dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    reads_blocks = any("blocks" in v for v in weights.values())
    lead = "model.quantized_decode=true"
    if not reads_blocks:
        kinds = layer_kinds(gguf)
        readable = set(cpu_blocks.BLOCK_BYTES) | set(amx_linear.GGUF_BLOCK_KINDS)
        if dtype not in ("float32", "bfloat16"):
            why = f"the block kernels take float32 or bfloat16 rows, not {dtype}"
        elif not set(kinds) <= readable:
            why = (f"the checkpoint's layers hold {'/'.join(k for k in kinds if k not in readable)} blocks, which no kernel "
                   f"here reads yet (read: {', '.join(sorted(readable))})")
        elif cpu_blocks.block_ops() is None:
            why = "the C++ block kernels could not be built here (see the warning above)"
        else:
            why = "this model's layers are not all dense layers of block kinds the kernels read"
        return f"{lead} not honoured: {why}; every step multiplies the dense {dtype} weights ({weights})"
    if cpu_blocks.isa() == "scalar" and block_linear_choice(dtype) == "scalar":
        missing = [f for f in AVX2_BLOCK_FLAGS if f not in cpu_flags()]
        return (f"{lead} honoured at one-row steps only: this CPU lacks {'/'.join(missing) or 'x86-64-v3'} (cpu_blocks' "
                f"vector path), so its scalar reference reads the blocks; larger steps multiply the dense {dtype} "
                f"weights ({weights})")
    return None


def cpu_linear_choice(dtype: str) -> dict[str, str]:
    """What runs a CPU engine's linears in `dtype`: {"float32_linear": ...} (decided by a start-up
    probe: two processes that differ here ran different kernels), {"bfloat16_linear": ...} (the
    decode-sized steps' linears, by the CPU flags and the environment), or {} for another dtype."""
    blocks = {"block_linear": block_linear_choice(dtype)}
    if dtype == "float32":
        return {"float32_linear": float32_linear_kernel()} | blocks
    if dtype == "bfloat16":
        return {"bfloat16_linear": amx_linear.kind()} | blocks
    return {}


def startup_choices(config: EngineConfig) -> dict[str, str]:
    """{"dtype", "threads", and on a CPU "float32_linear" or "bfloat16_linear", "block_linear" and
    "cpu_flags" (the kernel-relevant ones, "+"-joined)}: what this process runs."""
    dtype = resolve_engine_dtype(config.model.dtype, config.device.device, config.model.model)
    choices = {"dtype": dtype, "threads": str(torch.get_num_threads())}
    if resolve_device(config.device.device, check=False).type == "cpu":
        choices |= cpu_linear_choice(dtype) | {"cpu_flags": kernel_cpu_flags().replace(" ", "+") or "unknown"}
    return choices


def format_choices(choices: dict[str, str]) -> str:
    """The log line: `engine start-up choices: dtype=bfloat16, threads=2, bfloat16_linear=amx`."""
    return LOG_PREFIX + ", ".join(f"{k}={v}" for k, v in choices.items())


def parse_choices(line: str) -> dict[str, str] | None:
    """`format_choices` read back (from anywhere in `line`), or None when the line holds none."""
    at = line.find(LOG_PREFIX)
    if at < 0:
        return None
    pairs = (item.split("=", 1) for item in line[at + len(LOG_PREFIX):].strip().split(", ") if "=" in item)
    return {k: v for k, v in pairs}
