"""Background sampler of GPU (NVML) and host (psutil) telemetry for one run.

Writes <run>/telemetry.csv, one row per sample and GPU (one row per sample when there
is no GPU), columns `time, cpu_util_pct, rss_mb, gpu_index, gpu_util_pct,
gpu_mem_used_mb, gpu_power_w, sm_clock_mhz` (GPU columns empty without NVML), and
<run>/telemetry.json: `{"gpu": true, "devices": [...]}` or `{"gpu": false, "reason": ...}`
when NVML is missing or fails (recorded once; host sampling goes on).
`time` is seconds since `t0` (a `time.time()` value, default: when `start()` ran).
"""

from __future__ import annotations

import csv
import json
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

COLUMNS = [
    "time", "cpu_util_pct", "rss_mb", "gpu_index",
    "gpu_util_pct", "gpu_mem_used_mb", "gpu_power_w", "sm_clock_mhz",
]  # fmt: skip


class _Nvml:
    """NVML handles, or the reason there are none."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.names: list[str] = []
        self.reason: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv = pynvml
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                self.handles.append(h)
                name = pynvml.nvmlDeviceGetName(h)
                self.names.append(name.decode() if isinstance(name, bytes) else str(name))
            if not self.handles:
                self.reason = "NVML found no GPU"
        except ImportError as e:
            self.reason = f"nvidia-ml-py not installed ({e})"
        except Exception as e:  # pynvml.NVMLError and its many subclasses
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"

    def sample(self, index: int) -> list[float | None]:
        """[util %, memory used MB, power W, SM clock MHz] of one GPU (None where it fails)."""
        nv, h = self._nv, self.handles[index]
        calls = (
            lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20,
            lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        )
        out: list[float | None] = []
        for call in calls:
            try:
                out.append(float(call()))
            except Exception:  # one unsupported query must not stop the others
                out.append(None)
        return out

    def close(self) -> None:
        if self.handles:
            self._nv.nvmlShutdown()


class TelemetrySampler:
    """Samples every `interval_s` in a daemon thread between `start()` and `stop()`.

    `pid` selects the process whose RSS is recorded (default: this one), summed with its
    children's (looked up at every sample): for a server target that is the server and its
    EngineCore process, not the harness.
    """

    def __init__(
        self, run_dir: str | Path, interval_s: float = 0.5, t0: float | None = None, pid: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.interval_s = interval_s
        self.t0 = t0
        self._proc = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_samples = 0

    def start(self) -> TelemetrySampler:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.t0 is None:
            self.t0 = time.time()
        self._nvml = _Nvml()
        info: dict[str, Any] = {"gpu": bool(self._nvml.handles), "interval_s": self.interval_s}
        if self._nvml.handles:
            info["devices"] = self._nvml.names
        else:
            info["reason"] = self._nvml.reason
        (self.run_dir / "telemetry.json").write_text(json.dumps(info, indent=2))
        psutil.cpu_percent(interval=None)  # primes the counter; the first reading is 0
        self._file = (self.run_dir / "telemetry.csv").open("w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def sample_once(self) -> None:
        """Takes one sample and appends its rows to telemetry.csv."""
        assert self.t0 is not None
        t = round(time.time() - self.t0, 4)
        cpu = psutil.cpu_percent(interval=None)
        rss = self._tree_rss_mib()
        host = [t, cpu, rss]
        if not self._nvml.handles:
            self._writer.writerow(host + [None] * 5)
        for i in range(len(self._nvml.handles)):
            self._writer.writerow(host + [i, *self._nvml.sample(i)])
        self._file.flush()
        self.num_samples += 1

    def _tree_rss_mib(self) -> float | None:
        try:
            procs = [self._proc, *self._proc.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue  # a child that just exited
        return total / 2**20

    def stop(self) -> None:
        """Stops the thread (one last sample first) and closes the files."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample_once()
        self._file.close()
        self._nvml.close()

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
