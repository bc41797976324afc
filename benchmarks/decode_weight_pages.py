"""Decode-sized bf16 linears streaming their weights: 4 KiB pages vs one huge-page buffer, or
without vs with each call's hand-off prefetch of the next call's weight.

    python benchmarks/decode_weight_pages.py [--handoff] [--rows 1,4,16,32,64,128] [--iters 40] [--threads 2]

SmolLM2-135M's 30 layers (qkv, o, gate/up with the fused silu*up, down) and its LM head (the
fused greedy argmax), random bfloat16 weights packed for the decode kernels
(engine/kernels/amx_linear.py), twice in one process: each matrix in its own allocation (4 KiB
pages) and all of them in one `copies_on_huge_pages` buffer, as the engine's prepack lays them
out. Steps alternate between the two copies, a 128 MiB read between steps evicts the caches,
and the ratio of medians is printed per row count (> 1: huge pages faster). Needs a CPU with
AMX or AVX512-BF16 and Linux THP (`madvise` or `always`). With `--handoff` both sides read the
huge-page buffer, one passing each call the next call's weight (`next`, as the engine's planned
forward does) and one not (> 1: the hand-off faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.hugepages import copies_on_huge_pages, thp_mode  # noqa: E402
from engine.kernels import amx_linear  # noqa: E402
from engine.kernels.isa import cpu_flags  # noqa: E402

LAYERS, HIDDEN, QKV, INTER, VOCAB = 30, 576, 960, 1536, 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,64,128")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    ap.add_argument("--handoff", action="store_true", help="A/B the next-weight prefetch instead of the pages")
    args = ap.parse_args()
    if not amx_linear.available():
        sys.exit("this CPU has neither AMX nor AVX512-BF16 (or the C++ build failed): no decode-sized kernels")
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = amx_linear.amx_ops()
    assert ops is not None  # available() said so
    g = torch.Generator().manual_seed(0)

    def pack(n: int, k: int, interleave: int = 0) -> torch.Tensor:
        return ops.amx_pack(torch.randn(n, k, generator=g).bfloat16(), interleave)

    own = [pack(n, k, i) for _ in range(LAYERS)
           for n, k, i in ((QKV, HIDDEN, 0), (HIDDEN, HIDDEN, 0), (2 * INTER, HIDDEN, INTER), (HIDDEN, INTER, 0))]
    own.append(pack(VOCAB, HIDDEN))
    huge = copies_on_huge_pages(own)
    flush = torch.ones(2**25)

    def step(x: torch.Tensor, w: list[torch.Tensor], handoff: bool) -> None:
        for i in range(LAYERS):
            qkv, o, gate_up, down = w[4 * i : 4 * i + 4]
            nxt = (o, gate_up, down, w[4 * i + 4] if i + 1 < LAYERS else None) if handoff else (None,) * 4
            ops.amx_linear(x, qkv, QKV, nxt[0])
            ops.amx_linear(x, o, HIDDEN, nxt[1])
            ops.amx_linear(ops.amx_linear_silu_mul(x, gate_up, INTER, nxt[2]), down, HIDDEN, nxt[3])
        ops.amx_linear_argmax(x, w[-1], VOCAB)

    sides = (("no hand-off", huge, False), ("hand-off", huge, True)) if args.handoff else (
        ("4 KiB pages", own, False), ("huge pages", huge, False))

    nbytes = sum(t.numel() * t.element_size() for t in own)
    print(f"CPU flags: {' '.join(sorted(f for f in cpu_flags() if 'avx512' in f or 'amx' in f))}; threads {torch.get_num_threads()}; THP {thp_mode() or 'none'}; "
          f"kernels {amx_linear.kind()}; weights {nbytes / 1e6:.0f} MB")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, generator=g).bfloat16()
        times: dict[str, list[float]] = {name: [] for name, _, _ in sides}
        for i in range(args.iters + 2):
            for name, w, handoff in sides if i % 2 else sides[::-1]:
                flush.sum()
                t0 = time.perf_counter()
                step(x, w, handoff)
                if i >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        (na, _, _), (nb, _, _) = sides
        a, b = statistics.median(times[na]) * 1e3, statistics.median(times[nb]) * 1e3
        print(f"rows {rows:>4}: {na} {a:7.2f} ms ({nbytes / a / 1e6:5.1f} GB/s)   {nb} {b:7.2f} ms "
              f"({nbytes / b / 1e6:5.1f} GB/s)   ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
