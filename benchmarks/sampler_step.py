"""Sampled decode against greedy: the sampler alone, then the engine end to end (issue 38, item 1).

    python benchmarks/sampler_step.py [--parts sampler,e2e] [--rows 16] [--vocab 49152]
        [--repeats 15] [--rounds 3] [--requests 16] [--output-len 96] [--threads N] [--json OUT]

sampler  One sampling step over [rows, vocab] bfloat16 logits (the LM head's dtype; seeded
         Gaussian logits, sd 3) for greedy / temperature 1 / top-p 0.95 / top-k 50, by the old
         method (the logits upcast to float32, top-k and top-p by full sorts, softmax, the
         exponential race: `old_sample` below, the sampler as it was before this change), the
         new one (`Sampler.sample`), and between them `vocab`: every sampled row by inverse CDF
         over the vocabulary (`RowWeights`, as the sampler drew top-k rows before they drew
         among their candidates, 2026-12-04), all ending with the ids on the host. The methods
         alternate call by call; each figure is the median of `--repeats` calls. Printed: ms a
         step and the ratio to the same method's greedy step.
e2e      `LLM.generate` on the default model, `--requests` prompts x `--output-len` tokens
         (64-token corpus prompts, ignore_eos, so
         every request decodes the same count), greedy, temperature 1, top-p 0.95, top-k 50 and
         `top-k 50 vocab` (top-k 50 with the candidates path switched off: top-k rows drawn over
         the vocabulary, as before 2026-12-04), one after the other in `--rounds` rounds (the
         order rotates each round);
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.sample.sampler as sampler_module  # noqa: E402
from engine.sample.inverse_cdf import Workspace  # noqa: E402
from engine.sample.row_weights import RowWeights  # noqa: E402
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


def vocab_sample(logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """Every sampled row by inverse CDF over the vocabulary (top-k rows included)."""
    if batch.all_greedy:
        return greedy(logits).tolist()
    ids, unresolved = RowWeights(logits, batch.params, VOCAB_WORKSPACE).draw(batch.generators)
    if unresolved is None:
        return ids.tolist()
    # With the flags, as the sampler reads them; rows left outside the nucleus (rare) are not
    # finished here: a figure of the common step.
    return torch.stack([ids, unresolved.to(torch.int64)]).tolist()[0]


VOCAB_WORKSPACE = Workspace()


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
        times: dict[str, list[float]] = {"old": [], "vocab": [], "new": []}
        calls = {"old": old_sample, "vocab": vocab_sample, "new": new.sample}
        for call in calls.values():
            call(logits, batch)  # warm-up
        for _ in range(args.repeats):
            for method, call in calls.items():
                median_ms(lambda: call(logits, batch), times[method])  # noqa: B023
        out[name] = {f"{method}_ms": statistics.median(t) for method, t in times.items()}
    print(f"\nsampler alone: {args.rows} rows x {args.vocab} vocab, bfloat16 logits, "
          f"median of {args.repeats} alternated calls, torch threads {torch.get_num_threads()}")
    print(f"{'mode':<15}{'old ms':>10}{'vocab ms':>10}{'new ms':>10}{'old/new':>10}"
          f"{'old/greedy':>12}{'vocab/greedy':>14}{'new/greedy':>12}")
    g = out["greedy"]
    for name, r in out.items():
        print(f"{name:<15}{r['old_ms']:>10.3f}{r['vocab_ms']:>10.3f}{r['new_ms']:>10.3f}"
              f"{r['old_ms'] / r['new_ms']:>10.1f}{r['old_ms'] / g['old_ms']:>12.1f}"
              f"{r['vocab_ms'] / g['vocab_ms']:>14.1f}{r['new_ms'] / g['new_ms']:>12.1f}")
    return out


VOCAB_TOP_K = "top-k 50 vocab"


@contextmanager
def candidates_off() -> Iterator[None]:
    """Top-k rows sample over the vocabulary (`RowWeights`), in this process (the default
    executor runs the worker here): the sampler as it was before its top-k candidates."""
    saved = sampler_module.takes_top_k_path
    sampler_module.takes_top_k_path = lambda p: False
    try:
        yield
    finally:
        sampler_module.takes_top_k_path = saved


def bench_e2e(args: argparse.Namespace) -> dict[str, dict[str, float | list[float]]]:
    from engine.frontend.llm import LLM
    from workloads.prompts import PromptBuilder

    llm = LLM(model="smollm2")
    builder = PromptBuilder(llm.tokenizer)
    prompts = [{"prompt_token_ids": builder.token_ids(64, offset=997 * i)} for i in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=1.0))  # warm-up

    def run(name: str) -> tuple[float, float]:
        p = MODES.get(name, MODES["top-k 50"]).clone(max_tokens=args.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        with candidates_off() if name == VOCAB_TOP_K else nullcontext():
            outs = llm.generate(prompts, p)
        wall = time.perf_counter() - t0
        tpots = [o.metrics.decode_time / max(1, len(o.outputs[0].token_ids) - 1) for o in outs]
        return wall, statistics.median(tpots) * 1e3

    names = [*MODES, VOCAB_TOP_K]
    walls: dict[str, list[float]] = {n: [] for n in names}
    tpots: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            wall, tpot = run(name)
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
