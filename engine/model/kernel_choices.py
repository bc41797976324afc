"""The kernels an engine chose at start-up, in words, for the logs and for a benchmark's rounds.

Some choices follow the CPU's flags (bfloat16 linears on AMX or AVX512-BF16), some a timing probe
at each process's start that machine noise can tip (float32 linears: oneDNN prepacked or the plain
BLAS, `cpu_linear.onednn_float32_faster`; `dtype: auto` on avx512_bf16 without AMX). The engine core
reports them once it is ready (`ReadyInfo.choices`), the front end logs them as one line, and
benchmarks/round_conditions.py reads that line to name a round that ran other kernels.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model import amx_linear
from engine.model.cpu_linear import float32_linear_kernel
from engine.platform import resolve_device, resolve_engine_dtype

LOG_PREFIX = "engine start-up choices: "


def cpu_linear_choice(dtype: str) -> dict[str, str]:
    """What runs a CPU engine's linears in `dtype`: {"float32_linear": ...} (decided by a start-up
    probe: two processes that differ here ran different kernels), {"bfloat16_linear": ...} (the
    decode-sized steps' linears, by the CPU flags and the environment), or {} for another dtype."""
    if dtype == "float32":
        return {"float32_linear": float32_linear_kernel()}
    if dtype == "bfloat16":
        return {"bfloat16_linear": amx_linear.kind()}
    return {}


def startup_choices(config: EngineConfig) -> dict[str, str]:
    """{"dtype", "threads", and on a CPU "float32_linear" or "bfloat16_linear"}: what this process runs."""
    dtype = resolve_engine_dtype(config.model.dtype, config.device.device, config.model.model)
    choices = {"dtype": dtype, "threads": str(torch.get_num_threads())}
    if resolve_device(config.device.device, check=False).type == "cpu":
        choices |= cpu_linear_choice(dtype)
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
