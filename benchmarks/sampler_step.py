"""Sampled decode against greedy: the sampler alone, then the engine end to end (issue 38, item 1).

    python benchmarks/sampler_step.py [--parts sampler,e2e] [--rows 16] [--vocab 49152]
        [--repeats 15] [--rounds 3] [--requests 16] [--output-len 96] [--threads N] [--json OUT]

sampler  One sampling step over [rows, vocab] bfloat16 logits (the LM head's dtype; seeded
         Gaussian logits, sd 3) for greedy / temperature 1 / top-p 0.95 / top-k 50, by the old
         method (the logits upcast to float32, top-k and top-p by full sorts, softmax, the
         exponential race: `old_sample` below, the sampler as it was before this change) and the
         new one (`Sampler.sample`), both ending with the ids on the host. Old and new alternate
         call by call; each figure is the median of `--repeats` calls. Printed: ms a step and the
         ratio to the same method's greedy step.
e2e      `LLM.generate` on the default model, `--requests` prompts x `--output-len` tokens
         (64-token corpus prompts, ignore_eos, so
         every request decodes the same count), greedy, temperature 1, top-p 0.95
         and top-k 50, one after the other in `--rounds` rounds (the order rotates each round);
         the engine is built and warmed up first. Printed per mode: wall seconds and the median
         TPOT of the requests (decode time / (tokens - 1)), medians over rounds, and the ratio
         to greedy's TPOT of the same round (median over rounds, with its range).

The machine may be shared: read the ratios (taken from one run), not the absolute figures.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.sample.sampler import Sampler, SamplingBatch, apply_top_k_top_p_min_p, greedy  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

MODES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top-p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "top-k 50": SamplingParams(temperature=1.0, top_k=50),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="sampler,e2e")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    return p.parse_args(argv)


def old_sample(logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """The sampler before issue 38: float32 logits, full-sort masks, exponential race."""
    logits = logits.float()
    if batch.all_greedy:
        return greedy(logits).tolist()
    temps = torch.tensor([max(p.temperature, 1e-5) for p in batch.params])
    probs = torch.softmax(apply_top_k_top_p_min_p(logits / temps[:, None], batch.params), dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1).tolist()


def median_ms(fn: Callable[[], object], times: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    times.append((time.perf_counter() - t0) * 1e3)


def bench_sampler(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(torch.bfloat16)
    new = Sampler()
    out: dict[str, dict[str, float]] = {}
    for name, params in MODES.items():
        batch = SamplingBatch([params] * args.rows, [None] * args.rows)
        old_t: list[float] = []
        new_t: list[float] = []
        old_sample(logits, batch), new.sample(logits, batch)  # warm-up
        for _ in range(args.repeats):
            median_ms(lambda: old_sample(logits, batch), old_t)  # noqa: B023
            median_ms(lambda: new.sample(logits, batch), new_t)  # noqa: B023
        out[name] = {"old_ms": statistics.median(old_t), "new_ms": statistics.median(new_t)}
    print(f"\nsampler alone: {args.rows} rows x {args.vocab} vocab, bfloat16 logits, "
          f"median of {args.repeats} alternated calls, torch threads {torch.get_num_threads()}")
    print(f"{'mode':<15}{'old ms':>10}{'new ms':>10}{'old/new':>10}{'old/greedy':>12}{'new/greedy':>12}")
    g_old, g_new = out["greedy"]["old_ms"], out["greedy"]["new_ms"]
    for name, r in out.items():
        print(f"{name:<15}{r['old_ms']:>10.3f}{r['new_ms']:>10.3f}{r['old_ms'] / r['new_ms']:>10.1f}"
              f"{r['old_ms'] / g_old:>12.1f}{r['new_ms'] / g_new:>12.1f}")
    return out


def bench_e2e(args: argparse.Namespace) -> dict[str, dict[str, float | list[float]]]:
    from engine.llm import LLM
    from workloads.prompts import PromptBuilder

    llm = LLM(model="smollm2")
    builder = PromptBuilder(llm.tokenizer)
    prompts = [{"prompt_token_ids": builder.token_ids(64, offset=997 * i)} for i in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=1.0))  # warm-up

    def run(params: SamplingParams) -> tuple[float, float]:
        p = params.clone(max_tokens=args.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, p)
        wall = time.perf_counter() - t0
        tpots = [o.metrics.decode_time / max(1, len(o.outputs[0].token_ids) - 1) for o in outs]
        return wall, statistics.median(tpots) * 1e3

    names = list(MODES)
    walls: dict[str, list[float]] = {n: [] for n in names}
    tpots: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            wall, tpot = run(MODES[name])
            walls[name].append(wall)
            tpots[name].append(tpot)
    print(f"\nend to end: LLM.generate, default model, {args.requests} requests x {args.output_len} tokens "
          f"(ignore_eos), {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print(f"{'mode':<15}{'wall s':>9}{'TPOT ms':>9}{'TPOT / greedy (range)':>28}")
    out: dict[str, dict[str, float | list[float]]] = {}
    for name in names:
        ratios = [t / g for t, g in zip(tpots[name], tpots["greedy"], strict=True)]
        out[name] = {"wall_s": statistics.median(walls[name]), "tpot_ms": statistics.median(tpots[name]),
                     "tpot_ratio": statistics.median(ratios), "tpot_ratios": ratios}
        span = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"{name:<15}{out[name]['wall_s']:>9.2f}{out[name]['tpot_ms']:>9.2f}{span:>28}")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    result: dict[str, object] = {"args": vars(args)}
    if "sampler" in parts:
        result["sampler"] = bench_sampler(args)
    if "e2e" in parts:
        result["e2e"] = bench_e2e(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
