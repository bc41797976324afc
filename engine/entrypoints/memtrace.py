"""Opt-in memory tracing of the API server process (`server.tracemalloc_dir`, issue 60).

Where the server's RSS grows under a long load, two causes look alike from outside: Python
objects that are never released (a per-request map that is never emptied, tasks never
collected) and the C allocator holding freed memory it cannot hand back (glibc arenas
fragmented by many threads' short-lived allocations). This tracer tells them apart. It starts
`tracemalloc` and, every `interval_s`, appends one JSON line to `<dir>/memtrace.jsonl`:

    {"t_s", "rss_mib", "traced_mib", "traced_peak_mib",
     "malloc": {"arena_mib", "in_use_mib", "free_mib", "mmap_mib"},   # glibc mallinfo2, if any
     "tasks", "gc_objects",
     "growth": [{"site": "file:line", "kib": +d, "count": +n}, ...]}   # against the baseline

Samples start when the server is ready; `growth` is measured against the first sample taken
`baseline_after_s` or later (60 s: after a load's warm-up, when allocator pools are filled).
`traced_mib` flat while `rss_mib` grows points at the allocator; `traced_mib` growing, at the
sites listed in `growth`. The baseline snapshot and the last one are dumped to
`baseline.snapshot` and `final.snapshot` (`tracemalloc.Snapshot.load`) for grouping by full
traceback afterwards. Tracing slows every Python allocation (roughly 1.5-2x on the server's
hot path): it is for finding a leak, never for figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FRAMES = 12  # traceback depth kept per allocation (deep enough to reach the request handler)
TOP_SITES = 15
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
            "<unknown>")  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _mallinfo() -> dict[str, float] | None:
    """glibc's heap figures (MiB): bytes in arenas, in use, free inside them, and in mmap'd blocks;
    None on a libc without `mallinfo2` (glibc < 2.33, musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2 if name else None
    except (OSError, AttributeError):
        fn = None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    mib = 2**20
    return {"arena_mib": info.arena / mib, "in_use_mib": info.uordblks / mib, "free_mib": info.fordblks / mib,
            "mmap_mib": info.hblkhd / mib}  # fmt: skip


def rss_mib() -> float:
    """This process's resident set size (MiB), from /proc (0.0 where there is none)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class MemoryTracer:
    """Samples this process's memory every `interval_s` into `<directory>/memtrace.jsonl`."""

    def __init__(self, directory: str | Path, interval_s: float = 30.0, baseline_after_s: float = 60.0) -> None:
        """Create `directory` (ValueError, naming it, if that fails); tracing starts with `start()`."""
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"server.tracemalloc_dir: cannot create {str(directory)!r}: {exc.strerror}") from None
        if not os.access(self.directory, os.W_OK):
            raise ValueError(f"server.tracemalloc_dir: {str(directory)!r} is not writable")
        self.interval_s = interval_s
        self.baseline_after_s = baseline_after_s
        self._baseline: tracemalloc.Snapshot | None = None
        self._last: tracemalloc.Snapshot | None = None
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start tracemalloc and the sampling task (on the running loop)."""
        tracemalloc.start(FRAMES)
        self._t0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())
        logger.info("tracemalloc on (%d frames): a sample every %.0f s in %s", FRAMES, self.interval_s,
                    self.directory / "memtrace.jsonl")  # fmt: skip

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sample()
            except Exception:  # the tracer must never take the server down
                logger.exception("memtrace: sampling failed")

    def _snapshot(self) -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, f) for f in _IGNORED])

    def sample(self) -> dict[str, Any]:
        """Take one sample, append it to memtrace.jsonl and return it (see the module doc)."""
        t_s = time.monotonic() - self._t0
        snap = self._snapshot()
        if self._baseline is None and t_s >= self.baseline_after_s:
            self._baseline = snap
            snap.dump(str(self.directory / "baseline.snapshot"))
        current, peak = tracemalloc.get_traced_memory()
        growth = [
            {"site": f"{s.traceback[0].filename}:{s.traceback[0].lineno}", "kib": round(s.size_diff / 1024, 1),
             "count": s.count_diff}
            for s in (snap.compare_to(self._baseline, "lineno")[:TOP_SITES] if self._baseline else [])
            if s.size_diff
        ]  # fmt: skip
        record = {
            "t_s": round(t_s, 1),
            "rss_mib": round(rss_mib(), 2),
            "traced_mib": round(current / 2**20, 2),
            "traced_peak_mib": round(peak / 2**20, 2),
            "malloc": {k: round(v, 2) for k, v in (_mallinfo() or {}).items()},
            "tasks": len(asyncio.all_tasks()),
            "gc_objects": len(gc.get_objects()),
            "growth": growth,
        }
        with (self.directory / "memtrace.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._last = snap
        return record

    def close(self) -> None:
        """Stop sampling; take a last sample, dump it as final.snapshot and stop tracemalloc."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if not tracemalloc.is_tracing():
            return
        with contextlib.suppress(Exception):  # shutting down: a failed dump loses only the report
            self.sample()
            if self._last is not None:
                self._last.dump(str(self.directory / "final.snapshot"))
        tracemalloc.stop()


def top_tracebacks(baseline: str | Path, final: str | Path, limit: int = 10) -> list[str]:
    """The `limit` largest growths between two dumped snapshots, grouped by full traceback
    (one text block each, innermost frame last), for reading after a run."""
    old = tracemalloc.Snapshot.load(str(baseline))
    new = tracemalloc.Snapshot.load(str(final))
    out = []
    for stat in new.compare_to(old, "traceback")[:limit]:
        lines = [f"{stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks"]
        lines += [f"  {frame.filename}:{frame.lineno}" for frame in stat.traceback]
        out.append("\n".join(lines))
    return out


if __name__ == "__main__":  # python -m engine.entrypoints.memtrace DIR: growth by traceback
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m engine.entrypoints.memtrace DIR (holding baseline/final.snapshot)")
    folder = Path(sys.argv[1])
    for name in ("baseline.snapshot", "final.snapshot"):
        if not (folder / name).is_file():
            raise SystemExit(f"memtrace: {folder / name} is missing (was the server stopped with SIGTERM?)")
    print("\n\n".join(top_tracebacks(folder / "baseline.snapshot", folder / "final.snapshot")))
