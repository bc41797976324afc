"""What this machine is good at: the model dtype that `dtype="auto"` resolves to.

`dtype="auto"` (vLLM's name and meaning) is resolved once, here, and logged once:
- on a GPU: the checkpoint's dtype (an HF folder's `config.json` `torch_dtype`; a GGUF or a
  dummy / conf-only model: bfloat16, as vLLM loads a quantised GGUF);
- on a CPU: the faster of bfloat16 and float32 on this CPU. With `amx_bf16` (/proc/cpuinfo)
  bfloat16 GEMMs run 3-5x faster than float32 at the model's shapes: bfloat16. Without
  `avx512_bf16` either, bfloat16 runs at about a third of float32's speed: float32. With
  `avx512_bf16` but no AMX the flag does not decide: a Zen 5 runs bfloat16 GEMMs about 2x
  float32, an Intel Xeon whose AMX is hidden (a KVM guest) about 0.6x (its one `vdpbf16ps`
  port does no more than its two float32 FMA ports), so a short GEMM probe (< 0.2 s) at a
  prefill-sized shape of the default model decides, as it does where the flags cannot be read
  (not Linux x86).
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.model.source import resolve_source

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
PROBE_SHAPE = (512, 576, 1536)  # rows x SmolLM2's hidden size x its MLP width: a prefill chunk's GEMM


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none), read once per process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _gemm_speedup(rounds: int = 8) -> float:
    """How many times faster a bfloat16 [m, k] x [k, n] GEMM runs than a float32 one here
    (PROBE_SHAPE, best of `rounds` interleaved calls each)."""
    m, k, n = PROBE_SHAPE
    pairs = [(torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)) for dt in (torch.float32, torch.bfloat16)]
    t32, t16 = best_seconds_interleaved([functools.partial(torch.mm, a, b) for a, b in pairs], rounds)
    return t32 / t16


def best_seconds_interleaved(fns: Sequence[Callable[[], object]], rounds: int = 10) -> list[float]:
    """Best wall time of each of `fns`, measured in turn within each of `rounds` rounds (after
    one warm-up call each), so a burst of load from elsewhere slows them all alike instead of
    whichever ran during it. Measured on a 2-core KVM guest: the ratio of two GEMMs timed
    this way varied 1.44-1.48x over six processes; timed one after the other (best of 5 each),
    1.24-1.63x."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


@functools.cache
def fastest_cpu_dtype() -> tuple[str, str]:
    """("bfloat16" | "float32", why) for this CPU; computed once per process."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "bfloat16", "amx_bf16"
    if flags and platform.machine() in ("x86_64", "AMD64") and "avx512_bf16" not in flags:
        return "float32", "no avx512_bf16 / amx_bf16"
    speedup = _gemm_speedup()
    faster = "bfloat16" if speedup > 1.0 else "float32"
    where = "avx512_bf16, no AMX: " if "avx512_bf16" in flags else ""
    return faster, f"{where}GEMM probe: bfloat16 {speedup:.2f}x float32"


def serving_cpu_dtype() -> tuple[str, str]:
    """("bfloat16" | "float32", why) for a server on this CPU (servelab-serve's `dtype=auto`).

    A server's decode steps hold as many rows as it has streams (1-16 at a time on a small
    machine), where reading the weights dominates a step and bfloat16 halves them: bfloat16
    wherever the CPU multiplies it natively (`avx512_bf16` / `amx_bf16`), even where the
    offline batch's compute-bound GEMMs run faster in float32 (`fastest_cpu_dtype`). On the
    Intel Xeon whose AMX is hidden (avx512_bf16 only, docs/benchmarks.md): 16 streams 251.5
    against 168-184 output tok/s, one stream's TPOT 19.5 against 31-36 ms. Elsewhere: the
    offline choice."""
    found = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
    if found:
        return "bfloat16", f"serving: {found[0]}, weight reads halved"
    return fastest_cpu_dtype()


def checkpoint_dtype(source_kind: str, path: Path) -> str:
    """The dtype a checkpoint was saved in (an HF folder's `torch_dtype` / `dtype`); bfloat16 otherwise."""
    if source_kind == "hf":
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return name if name in DTYPE_NAMES else "bfloat16"
    return "bfloat16"  # GGUF (quantised: vLLM dequantises to bfloat16), dummy and conf-only models


_logged: set[tuple[str, str]] = set()


@functools.cache
def warn_emulated_bfloat16() -> bool:
    """Once per process, where `dtype=bfloat16` is asked for on an x86 CPU that multiplies bfloat16
    natively neither way (no avx512_bf16 / amx_bf16): a warning naming the option, what the CPU
    lacks and what runs (emulated products, about a third of float32's speed and less: the GEMM
    probe measured 0.014x on a 2-core AMD EPYC with AVX2 only). True where it warned."""
    flags = cpu_flags()
    if not flags or platform.machine() not in ("x86_64", "AMD64") or set(BF16_CPU_FLAGS) & flags:
        return False
    logger.warning("dtype=bfloat16 on a CPU without %s: its bfloat16 products are emulated (float32's "
                   "speed at best, far below it at prefill sizes); dtype=auto picks float32 here",
                   " / ".join(BF16_CPU_FLAGS))
    return True


def resolve_dtype(dtype: str, device: torch.device, source_kind: str = "gguf", path: Path | None = None) -> str:
    """The concrete dtype name for `dtype` on `device` ("auto" resolved; others returned as is).

    ValueError for a name that is neither "auto" nor one of DTYPE_NAMES. The resolution of
    "auto" is logged once per process ("dtype auto -> bfloat16 (avx512_bf16)").
    """
    if dtype in DTYPE_NAMES:
        if dtype == "bfloat16" and device.type == "cpu":
            warn_emulated_bfloat16()
        return dtype
    if dtype != "auto":
        raise ValueError(f"dtype: must be auto or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if device.type == "cpu":
        name, why = fastest_cpu_dtype()
    else:
        name, why = checkpoint_dtype(source_kind, path or Path()), f"checkpoint dtype on {device.type}"
    if (name, why) not in _logged:
        _logged.add((name, why))
        logger.info("dtype auto -> %s (%s)", name, why)
    return name


def resolve_device(name: str, check: bool = True) -> torch.device:
    """The torch device for a config's `device.device`: "auto" is CUDA where available, else the CPU.

    ValueError for "cuda..." on a machine without a CUDA GPU, unless `check` is False (callers
    that only ask which kind of device a config names).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if check and name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA GPU is available")
    return torch.device(name)


def resolve_engine_dtype(dtype: str, device: str, model: str) -> str:
    """`resolve_dtype` for a config's `model.dtype`, `device.device` ("auto" | "cpu" | "cuda..."), `model`."""
    if dtype in DTYPE_NAMES:
        return dtype
    dev = resolve_device(device, check=False)
    kind, path = "gguf", None
    if dev.type != "cpu":
        try:
            source = resolve_source(model)
            kind, path = source.kind, source.path
        except ValueError:  # reported by the loader, with its own message
            pass
    return resolve_dtype(dtype, dev, kind, path)
