"""What a small piece of host work costs right after a step has streamed its weights (issue 38, item 3).

    python benchmarks/cold_after_stream.py [--sizes-mib 0,2,8,32,96,256] [--repeats 200] [--threads 2]
        [--json out.json]

A batch-1 decode step reads its ~96 MB of weights once, and everything else the step touches
(the Python interpreter's objects, torch's dispatcher and allocator, a layer's activations and KV
cache) has been pushed out of the caches by them when it is next needed. This times three small
pieces of work, each right after `torch.sum` has read a buffer of the given size on `--threads`
threads (0: nothing read in between, the work's own data hot):

- `embedding`: one row of a [49152, 576] bfloat16 table (SmolLM2's embedding, 56 MB) through
  `F.embedding`, as the engine embeds a decode step's token;
- `add_rms_norm`: servelab's fused residual add and RMS norm on one [1, 576] row (engine/kernels/csrc/
  layer_ops.cpp; skipped, with the reason printed, where the extension cannot be built);
- `python`: a dict of 200 short lists built in pure Python, a stand-in for the engine's per-step
  bookkeeping.

The buffers sit on huge pages where the kernel gives them (engine/hugepages.py), as the engine's
packed weights do, so the TLB is not what is measured. Median over `--repeats` of each; the
ratio is to the hot figure in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import cpu_flags, cpu_model, format_flags  # noqa: E402

from engine.hugepages import copies_on_huge_pages  # noqa: E402


def _python_work() -> None:
    d = {}
    for i in range(200):
        d[i] = [i, i + 1, i + 2]


def _works() -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The timed pieces of work by name, and those left out with the reason."""
    table = torch.randn(49152, 576).to(torch.bfloat16)
    ids = torch.tensor([1234])
    works: dict[str, Callable[[], object]] = {"embedding": lambda: F.embedding(ids, table)}
    skipped = {}
    from engine.kernels.cpu_kernels import kernels

    ops = kernels()
    if ops is None:
        skipped["add_rms_norm"] = "servelab's CPU kernels did not build here (engine/kernels/cpu_kernels.py)"
    else:
        x, res = torch.randn(1, 576).to(torch.bfloat16), torch.randn(1, 576).to(torch.bfloat16)
        weight = torch.ones(576, dtype=torch.bfloat16)
        works["add_rms_norm"] = lambda: ops.add_rms_norm_(x, res, weight, 1e-5)
    works["python"] = _python_work
    return works, skipped


def _median_us(work: Callable[[], object], before: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        before()
        t = time.perf_counter_ns()
        work()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="0,2,8,32,96,256",
                    help="buffer sizes read before each timed piece of work, MiB (0: none)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=200, help="timings per piece of work and size (median)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the engine's default on 2 cores)")
    ap.add_argument("--json", type=Path, help="also write the table here")
    args = ap.parse_args()
    try:
        sizes = [float(s) for s in args.sizes_mib.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes-mib: comma-separated numbers, got {args.sizes_mib!r}")
    if args.repeats < 1 or args.threads < 1 or any(s < 0 for s in sizes):
        ap.error("--repeats and --threads must be at least 1 and --sizes-mib not negative")
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; {format_flags(cpu_flags())}; torch {torch.__version__}, {args.threads} threads")
    works, skipped = _works()
    for name, why in skipped.items():
        print(f"{name}: skipped, {why}")
    rows: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for mib in sizes:
            buf = copies_on_huge_pages([torch.ones(max(1, int(mib * 2**20) // 4))])[0] if mib > 0 else None
            before = (lambda b=buf: b.sum()) if buf is not None else (lambda: None)
            rows[f"{mib:g}"] = {name: _median_us(work, before, args.repeats) for name, work in works.items()}
            del buf
    hot = rows.get("0")
    print(f"{'read before (MiB)':>18} " + " ".join(f"{n:>22}" for n in works))
    for mib, row in rows.items():
        cells = [f"{row[n]:8.2f} us" + (f" ({row[n] / hot[n]:5.1f}x)" if hot else "") for n in works]
        print(f"{mib:>18} " + " ".join(f"{c:>22}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "flags": cpu_flags(), "threads": args.threads,
                                         "us": rows, "skipped": skipped}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
