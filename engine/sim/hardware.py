"""Hardware profiles: the peak numbers a roofline needs, per device.

Packaged profiles live in `engine/sim/profiles/<name>.yaml`; `HardwareProfile.load` also takes
a yaml path, or other folders to search first. Datasheet profiles carry dense (no
sparsity) peaks plus efficiency factors (the achievable fraction of peak); the measured
CPU profile carries achieved numbers with efficiency 1.0. `measure_cpu_profile()`
produces such a profile for the machine it runs on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.dtypes import canonical_dtype, torch_dtype

PROFILES_DIR = Path(__file__).parent / "profiles"
# CPU flags that change a GEMM's speed by a large factor per dtype (recorded in measured profiles).
GEMM_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


@dataclass(frozen=True)
class HardwareProfile:
    """One device type (numbers are per device) and how many a node holds.

    peak_tflops: dense tensor throughput per dtype (a dtype absent here is unsupported).
    mem_bandwidth_gbs / interconnect_bw_gbs: GB/s (1e9 bytes/s); interconnect is the
    per-device NVLink figure used for tensor-parallel all-reduce.
    gemm_efficiency / mem_efficiency / comm_efficiency: achievable fraction of peak.
    allreduce_latency_s: fixed cost of one all-reduce (launch + synchronisation).
    step_overhead_s: fixed cost of one engine step outside the kernels.
    cpu_isa: a measured CPU profile's GEMM-relevant flags (`GEMM_CPU_FLAGS` present on the CPU
    it was measured on); empty for datasheet profiles. A bfloat16 GEMM runs ~1000x faster with
    `amx_bf16` than without native bf16 units, so a profile measured on one CPU says little
    about another: `host_mismatch()` tells.
    """

    name: str
    peak_tflops: dict[str, float]
    mem_bandwidth_gbs: float
    memory_gb: float
    interconnect_bw_gbs: float = 0.0
    num_devices: int = 1
    gemm_efficiency: float = 1.0
    mem_efficiency: float = 1.0
    comm_efficiency: float = 1.0
    allreduce_latency_s: float = 0.0
    step_overhead_s: float = 0.0
    cpu_isa: list[str] = field(default_factory=list)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        """Achievable FLOP/s for `dtype` (peak * gemm_efficiency)."""
        name = canonical_dtype(dtype)
        if name not in self.peak_tflops:
            raise ValueError(
                f"hardware {self.name!r} has no {name} throughput (has {sorted(self.peak_tflops)})"
            )
        return self.peak_tflops[name] * 1e12 * self.gemm_efficiency

    def host_mismatch(self, host_flags: frozenset[str] | None = None) -> str | None:
        """Why this measured CPU profile does not describe this machine's CPU, or None.

        None for a profile without `cpu_isa` (datasheets) and where the flags cannot be read.
        """
        if not self.cpu_isa:
            return None
        if host_flags is None:
            from engine.kernels.isa import cpu_flags

            host_flags = cpu_flags()
        if not host_flags:
            return None
        host = [f for f in GEMM_CPU_FLAGS if f in host_flags]
        if set(host) == set(self.cpu_isa):
            return None
        return (f"hardware profile {self.name!r} was measured on a CPU with {self.cpu_isa}, this one has {host}: "
                "its GEMM rates do not apply here; re-measure with engine.sim.hardware.measure_cpu_profile()")  # fmt: skip

    @property
    def mem_bw(self) -> float:
        """Achievable memory bandwidth in bytes/s."""
        return self.mem_bandwidth_gbs * 1e9 * self.mem_efficiency

    @property
    def comm_bw(self) -> float:
        """Achievable interconnect bandwidth in bytes/s (0: no interconnect)."""
        return self.interconnect_bw_gbs * 1e9 * self.comm_efficiency

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    # ---- files --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        known = set(cls.__dataclass_fields__)
        extra = {k: v for k, v in d.items() if k not in known}
        args = {k: v for k, v in d.items() if k in known and k != "extra"}
        args["peak_tflops"] = {canonical_dtype(k): float(v) for k, v in (d.get("peak_tflops") or {}).items()}
        return cls(**args, extra={**d.get("extra", {}), **extra})

    @classmethod
    def load(cls, name_or_path: str, search_dirs: Sequence[str | Path] = ()) -> HardwareProfile:
        """From a yaml path, or `<name>.yaml` in `search_dirs` then in the packaged `profiles/`."""
        path = Path(name_or_path)
        dirs = [*map(Path, search_dirs), PROFILES_DIR]
        if not path.is_file():
            path = next((d / f"{name_or_path}.yaml" for d in dirs if (d / f"{name_or_path}.yaml").is_file()), path)
        if not path.is_file():
            known = ", ".join(sorted({p.stem for d in dirs for p in d.glob("*.yaml")}))
            raise FileNotFoundError(f"no hardware profile {name_or_path!r} (known: {known})")
        return cls.from_dict(yaml.safe_load(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["extra"]:
            del d["extra"]
        return d

    def save(self, path: str | Path, header: str = "") -> None:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        Path(path).write_text(comment + text)


# ---- measuring this CPU -------------------------------------------------------------
def _best_time(fn: Any, repeats: int, budget_s: float = 2.0) -> float:
    """Best of up to `repeats` timed calls after a warm-up; stops early past `budget_s`."""
    start = time.perf_counter()
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if t0 - start > budget_s:
            break
    return best


def measure_gemm_tflops(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """Achieved TFLOP/s of an n x n x n torch matmul on the CPU (best of `repeats`)."""
    import torch

    tdtype = torch_dtype(canonical_dtype(dtype))
    a = torch.randn(n, n).to(tdtype)  # [n, n]
    b = torch.randn(n, n).to(tdtype)  # [n, n]
    seconds = _best_time(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / seconds / 1e12


def measure_copy_gbs(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Achieved GB/s of a large tensor copy (read + write counted) on the CPU."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)  # [num_bytes / 4]
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / seconds / 1e9


def measure_cpu_profile(
    name: str = "cpu-2core",
    out_path: str | Path | None = None,
    memory_gb: float | None = None,
    rounds: int = 3,
) -> HardwareProfile:
    """Time a GEMM per dtype and a memory copy with torch; return (and optionally save) a profile.

    Peaks are the best achieved numbers over `rounds` (a shared machine is noisy), so
    efficiencies are 1.0. GEMMs are 1024^3 in fp32 and 512^3 in half precision (slow on CPUs
    without native bf16/fp16 units). `memory_gb` defaults to the
    machine's total RAM (psutil). The interconnect is modelled as a memory copy (tensor
    parallel ranks on one CPU exchange data through shared memory).
    """
    import psutil
    import torch

    from engine.kernels.isa import cpu_flags

    sizes = {"fp32": 1024, "bf16": 512, "fp16": 512}
    tflops = {d: round(max(measure_gemm_tflops(d, n) for _ in range(rounds)), 4) for d, n in sizes.items()}
    copy_gbs = round(max(measure_copy_gbs() for _ in range(rounds)), 2)
    profile = HardwareProfile(
        name=name,
        peak_tflops=tflops,
        mem_bandwidth_gbs=copy_gbs,
        memory_gb=round(memory_gb if memory_gb is not None else psutil.virtual_memory().total / 1e9, 1),
        interconnect_bw_gbs=copy_gbs,
        num_devices=1,
        cpu_isa=[f for f in GEMM_CPU_FLAGS if f in cpu_flags()],
        notes=f"measured with torch {torch.__version__}, {torch.get_num_threads()} threads",
    )
    if out_path is not None:
        profile.save(
            out_path, header="Produced by engine.sim.hardware.measure_cpu_profile() on this machine."
        )
    return profile
