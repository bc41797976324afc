"""Batch-1 decode with the layers' team step on and off, alternating in one process (issue 38, item 3).

    python benchmarks/decode_team.py [--pairs 8] [--output-len 128] [--input-len 128] [--threads 2]

The offline engine on the default model (SmolLM2-135M's Q4_1 GGUF, `model.quantized_decode`: the
checkpoint's blocks), one request at a time, greedy, EOS ignored. Each generate decodes a fresh
random prompt with `planned_layers`' team step on (one OpenMP parallel region for a step's
layers: engine/kernels/planned_layers.py) or off (`torch.ops.servelab.set_decode_team(False)`: the
same kernels called one by one through torch's dispatcher), in ABBA order over `--pairs` pairs
after one warm-up of each. Prints each side's TPOT (time between the first and the last token
over the tokens between) as the median and range over its generates, the ratio of medians, and
whether both sides made the same tokens for the same prompts (they must: the same numbers bit for
bit). Needs a CPU with AVX512-VNNI (the team step runs the GGUF block kernels).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import cpu_flags, cpu_model, format_flags  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=8, help="generates per side, alternating ABBA")
    ap.add_argument("--input-len", type=int, default=128, help="random prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    if min(args.pairs, args.input_len, args.threads) < 1 or args.output_len < 2:
        ap.error("--pairs, --input-len and --threads must be at least 1, --output-len at least 2")
    torch.set_num_threads(args.threads)
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model="smollm2", max_num_seqs=1, max_model_len=args.input_len + args.output_len + 16)
    ops = torch.ops.servelab
    if not hasattr(ops, "set_decode_team") or not ops.set_decode_team(None):
        print("the team step is not built here: it needs AVX512-VNNI and the C++ kernels (engine/kernels/csrc/gguf_blocks.h)")
        return 2
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.pairs)]

    def decode(team: bool, prompt: list[int]) -> tuple[float, list[int]]:
        ops.set_decode_team(team)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        t = out.metrics.token_times
        return (t[-1] - t[0]) / (len(t) - 1) * 1e3, list(out.outputs[0].token_ids)

    for team in (True, False):
        decode(team, prompts[0])
    tpot: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {True: [], False: []}
    for i, prompt in enumerate(prompts):
        for team in (True, False) if i % 2 == 0 else (False, True):
            ms, ids = decode(team, prompt)
            tpot[team].append(ms)
            tokens[team].append(ids)
    ops.set_decode_team(True)
    print(f"CPU: {cpu_model()}; {format_flags(cpu_flags())}; torch {torch.__version__}, {args.threads} threads")
    print(f"batch 1, {args.input_len} prompt tokens, {args.output_len} output tokens, greedy, {args.pairs} pairs ABBA")
    for team, name in ((True, "team step"), (False, "op by op")):
        v = tpot[team]
        print(f"  {name:10s} TPOT {statistics.median(v):.3f} ms ({min(v):.3f}-{max(v):.3f})")
    print(f"  team / op by op: {statistics.median(tpot[True]) / statistics.median(tpot[False]):.3f}x; "
          f"same tokens: {tokens[True] == tokens[False]}")  # fmt: skip
    return 0 if tokens[True] == tokens[False] else 1


if __name__ == "__main__":
    sys.exit(main())
