"""This CPU's instruction sets, and what they make fast: the facts every kernel choice starts from.

`cpu_flags()` reads /proc/cpuinfo once per process. The dtype `dtype="auto"` resolves to on a CPU
(engine/platform.py resolves it, this module decides it):
- with `amx_bf16`, bfloat16 GEMMs run 3-5x faster than float32 at the model's shapes: bfloat16;
- without `avx512_bf16` either, bfloat16 products are emulated at a third of float32's speed or
  less: float32;
- with `avx512_bf16` but no AMX the flag does not decide: a Zen 5 runs bfloat16 GEMMs about 2x
  float32, an Intel Xeon whose AMX is hidden (a KVM guest) about 0.6x (its one `vdpbf16ps` port
  does no more than its two float32 FMA ports), so a short GEMM probe (< 0.2 s) at a
  prefill-sized shape of the default model decides, as it does where the flags cannot be read
  (not Linux x86).
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# The instruction sets the CPU kernels choose by (engine/kernels/csrc): what a run records of its CPU.
KERNEL_CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
                    "amx_int8", "amx_tile", "neon", "asimd")  # fmt: skip
# cpu_blocks' AVX2 path needs all three (x86-64-v3)
AVX2_BLOCK_FLAGS = ("avx2", "fma", "f16c")
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


def kernel_cpu_flags() -> str:
    """The kernel-relevant flags of this CPU, space-separated ("" where /proc/cpuinfo has none)."""
    flags = cpu_flags()
    return " ".join(f for f in KERNEL_CPU_FLAGS if f in flags)


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
