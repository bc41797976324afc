"""What the planned forward's profiler ranges cost when no profiler runs, against a decode step.

    python benchmarks/plan_ranges_cost.py [--batch 4] [--tokens 32] [--iters 2000] [--threads 1]

engine/kernels/forward_plan.py opens a range per part of every layer (`part_ranges`, 8 per layer
and one for the final norm) around the planned forward's kernels; unprofiled each is a `with` on a
shared null context, after one `torch.autograd._profiler_enabled()` per forward. This times that
machinery alone, for the default model's layer count (median of `--iters` runs of one forward's
worth), and the forward phase of the engine's decode steps (median over the decode steps of a
greedy run of `--batch` requests of `--tokens` tokens, the plan pinned on with
`float32_linear=prepacked`), and prints the first as a share of the second. (planned_layers.cpp's
C++ loop checks the thread's RecordFunction callbacks per range: not timed here.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.forward_plan import part_ranges  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

RANGES_PER_LAYER = 8  # norm, qkv, attention, o, post-norm, gate_up, silu, down (forward_plan.planned_forward)


def machinery_us(layers: int, iters: int) -> float:
    """Median µs of one forward's range machinery, unprofiled."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        in_norm, in_linears, in_attention, in_mlp = part_ranges()
        for _ in range(layers):
            with in_norm:
                pass
            with in_linears:
                pass
            with in_attention:
                pass
            with in_linears:
                pass
            with in_norm:
                pass
            with in_linears:
                pass
            with in_mlp:
                pass
            with in_linears:
                pass
        with in_norm:
            pass
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if min(args.batch, args.tokens, args.iters, args.threads) < 1:
        parser.error("--batch, --tokens, --iters and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    from engine.frontend.llm import LLM

    llm = LLM(model="smollm2", max_num_seqs=max(args.batch, 1), num_gpu_blocks_override=128,
              float32_linear="prepacked")  # fmt: skip
    try:
        model = llm.engine_core._runner.model
        if model.model.plan is None:
            sys.exit("plan_ranges_cost: no CPU forward plan here (C++ layer kernels or oneDNN packing missing)")
        layers = len(model.model.layers)
        prompts = [list(range(200 + 7 * i, 230 + 7 * i)) for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        llm.step_stats.clear()
        llm.generate(prompts, params, use_tqdm=False)
        decode = [s.forward_time for s in llm.step_stats if s.num_prefill_tokens == 0 and s.num_decode_tokens]
        if not decode:
            sys.exit("plan_ranges_cost: the run had no decode-only step")
        forward_ms = 1e3 * statistics.median(decode)
        cost = machinery_us(layers, args.iters)
        print(f"plan ranges, unprofiled: {cost:.1f} us per forward ({layers} layers, "
              f"{RANGES_PER_LAYER * layers + 1} ranges); decode step forward (batch {args.batch}, "
              f"{len(decode)} steps): median {forward_ms:.2f} ms; share {100 * cost / (1e3 * forward_ms):.3f}%")
    finally:
        llm.engine_core.shutdown()


if __name__ == "__main__":
    main()
