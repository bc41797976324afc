"""N-gram speculative decoding on a repetitive workload: acceptance rate and speed-up.

    python benchmarks/spec_decode.py [--num-requests 6] [--output-len 64] [--k 0 2 4]
        [--prompt-lookup-min 2] [--prompt-lookup-max 5] [--max-num-seqs 1] [--threads N]
        [--dtype auto|float32|bfloat16] [--json OUT]

Workload: requests whose answers repeat their prompt, the case prompt lookup is for: code
edits (reproduce a given function with one change) and summaries that quote the text (half
and half), as few-shot completion prompts (one worked example each, so the 135M model does
copy), greedy, up to `--output-len` tokens, on the default model (SmolLM2-135M GGUF). For each
`--k` (0: no speculation) one engine is built and warmed up (untimed), then the whole
workload runs through `LLM.generate` with `--max-num-seqs` requests at a time (1 by default: the
decode-latency-bound case speculation helps; on a CPU a verify step of 1 + k tokens costs
more than a one-token decode, so large batches gain less).

Printed per k: wall seconds, output tokens/s, engine steps, drafts verified, acceptance rate
(accepted / draft tokens), mean accepted length (1 + accepted / requests verified with drafts,
vLLM's definition: tokens emitted per request per verify step), speed-up against k = 0, and
whether the greedy outputs are identical to k = 0. In float32 they must be (tests check it);
in bfloat16 (`--dtype auto` on a CPU with avx512_bf16) a verify step's multi-row GEMMs round
differently from one-row decodes, so outputs may part after a near-tie, as bf16 chunked
prefill does (tests/test_oracle_bf16.py accepts >= 90% positional agreement): the share of
agreeing tokens is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.frontend.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

CODE = [
    "def area(width, height):\n    result = width * height\n    print('area', result)\n    return result\n",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self, n):\n        self.count += n\n",
]
TEXTS = [
    "The river flows past the old mill every spring. Farmers bring their grain to the mill. "
    "The miller grinds it into flour and sells the flour in the town market.",
    "Solar panels turn sunlight into electricity. The electricity charges batteries during the day. "
    "At night the batteries power the lights of the house.",
    "The library opens at nine in the morning. Students come to read and to study. "
    "The library closes at six in the evening on weekdays.",
]


def workload(n: int) -> list[str]:
    """Few-shot completion prompts (the small model copies reliably after one example)."""
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            code, example = CODE[(i // 2) % len(CODE)], CODE[(i // 2 + 1) % len(CODE)]
            prompts.append(
                f"# Before:\n{example}\n# After (with a comment on top):\n# Edited.\n{example}\n"
                f"# Before:\n{code}\n# After (with a comment on top):\n# Edited.\n"
            )
        else:
            text, example = TEXTS[(i // 2) % len(TEXTS)], TEXTS[(i // 2 + 1) % len(TEXTS)]
            prompts.append(
                f"Text: {example}\nSummary, quoting the text: \"{example}\" In short, it describes a routine.\n\n"
                f"Text: {text}\nSummary, quoting the text: \""
            )
    return prompts


def run_one(k: int, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    spec = None
    if k > 0:
        spec = {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    llm = LLM(max_model_len=1024, max_num_seqs=args.max_num_seqs, dtype=args.dtype, speculative_config=spec)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up, untimed
    llm.step_stats.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = llm.step_stats
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts = sum(s.num_drafts for s in steps)
    draft_tokens = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    llm.engine_core.shutdown()
    n_out = sum(len(t) for t in tokens)
    dtype = llm.config.model.dtype
    return {
        "dtype": dtype,
        "k": k, "wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall, "steps": len(steps),
        "num_drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "_tokens": tokens,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of output positions (position by position, as tests/test_oracle_bf16.py counts)
    where two runs' greedy tokens agree."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += max(len(x), len(y))
        same += sum(1 for i, j in zip(x, y, strict=False) if i == j)
    return same / total if total else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: the faster of bf16 / fp32 here)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = sorted(set(args.k) | {0})
    prompts = workload(args.num_requests)
    results = [run_one(k, args, prompts) for k in ks]
    base = results[0]
    print(f"workload: {args.num_requests} repetitive requests (code edits, quoting summaries), greedy, "
          f"<= {args.output_len} output tokens, dtype={base['dtype']}, max_num_seqs={args.max_num_seqs}, torch threads="
          f"{torch.get_num_threads()}, ngram lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}")
    print(f"{'k':>2} {'wall s':>7} {'tok/s':>7} {'steps':>6} {'drafts':>7} {'accept':>7} {'mean len':>8} "
          f"{'speed-up':>8}  same output (tokens agreeing)")
    for r in results:
        r["speedup"] = base["wall_s"] / r["wall_s"]
        r["identical_to_k0"] = r["_tokens"] == base["_tokens"]
        r["token_agreement"] = agreement(r["_tokens"], base["_tokens"])
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mean = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{r['k']:>2} {r['wall_s']:>7.2f} {r['output_tok_s']:>7.1f} {r['steps']:>6} {r['draft_tokens']:>7} "
              f"{rate:>7} {mean:>8} {r['speedup']:>7.2f}x  {r['identical_to_k0']} ({r['token_agreement']:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")}
                                               for r in results], indent=2))


if __name__ == "__main__":
    main()
