"""Tensor-parallel scaling: the same offline batch at TP=1, 2, ... and the communication share.

    python benchmarks/parallel_scaling.py [--model smollm2] [--tp 1,2] [--dtype float32]
        [--num-prompts 8] [--prompt-len 64] [--output-len 32] [--ep] [--device auto]
        [--load-format auto] [--num-layers N]

For each tensor-parallel size: one `LLM(model, tensor_parallel_size=N)` (TP=1: the in-process
executor; N > 1: one worker process per rank, gloo on a CPU, NCCL on GPUs), one warm-up
generate, then the timed generate of `--num-prompts` random-token prompts of `--prompt-len`
tokens, `--output-len` greedy tokens each (ignore_eos). Printed per size: wall seconds, output
tokens/s, mean step ms of prefill-only and decode-only steps, and rank 0's collective time
(all-reduce, logits gather, token broadcast, MoE dispatch / combine) as a share of step time,
from the engine's own StepStats (the steps.csv columns `comm_time`, `all_reduce_time`, ...).
On a 2-core CPU, TP=2 is expected to be slower (two processes share two cores and every layer
adds two all-reduces); the script is meant for a multi-GPU machine as it is.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.frontend.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.seam import StepStats  # noqa: E402


def run_one(args: argparse.Namespace, tp: int) -> dict[str, float]:
    kwargs: dict = dict(model=args.model, dtype=args.dtype, tensor_parallel_size=tp, max_num_seqs=max(8, args.num_prompts),
                        max_model_len=args.prompt_len + args.output_len + 16, device=args.device,
                        load_format=args.load_format, enable_expert_parallel=args.ep and tp > 1)
    if args.num_layers:
        kwargs["num_layers_override"] = args.num_layers
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    try:
        rng = random.Random(0)
        vocab = 1000  # low ids: valid in every vocabulary
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
        first = len(llm.step_stats)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = llm.step_stats[first:]
    finally:
        llm.engine_core.shutdown()
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tp": tp, "start_s": start_s, "wall_s": wall, "tok_s": ntok / wall, **_step_summary(steps)}


def _mean_ms(values: list[float]) -> float:
    return 1000 * sum(values) / len(values) if values else float("nan")


def _step_summary(steps: list[StepStats]) -> dict[str, float]:
    decode = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    prefill = [s for s in steps if s.num_prefill_tokens > 0 and s.num_decode_tokens == 0]
    total = sum(s.step_time for s in steps) or float("nan")
    return {
        "steps": len(steps),
        "prefill_step_ms": _mean_ms([s.step_time for s in prefill]),
        "decode_step_ms": _mean_ms([s.step_time for s in decode]),
        "comm_share": sum(s.comm_time for s in steps) / total,
        "all_reduce_share": sum(s.all_reduce_time for s in steps) / total,
        "moe_share": sum(s.dispatch_time + s.combine_time for s in steps) / total,
        "decode_comm_ms": _mean_ms([s.comm_time for s in decode]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-layers", type=int, default=0, help="num_layers_override (0: the model's)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ep", action="store_true", help="enable_expert_parallel for TP > 1 (MoE models)")
    args = p.parse_args()
    print(f"model={args.model} dtype={args.dtype} device={args.device} prompts={args.num_prompts} x "
          f"{args.prompt_len} tokens, {args.output_len} output tokens each, ep={args.ep}")
    rows = [run_one(args, int(tp)) for tp in args.tp.split(",")]
    head = (f"{'tp':>3} {'start_s':>8} {'wall_s':>7} {'tok/s':>7} {'steps':>5} {'prefill_ms':>10} {'decode_ms':>9} "
            f"{'comm%':>6} {'allred%':>7} {'moe%':>5} {'decode_comm_ms':>14}")
    print(head)
    for r in rows:
        print(f"{r['tp']:>3} {r['start_s']:>8.1f} {r['wall_s']:>7.2f} {r['tok_s']:>7.1f} {r['steps']:>5} "
              f"{r['prefill_step_ms']:>10.1f} {r['decode_step_ms']:>9.1f} {100 * r['comm_share']:>6.1f} "
              f"{100 * r['all_reduce_share']:>7.1f} {100 * r['moe_share']:>5.1f} {r['decode_comm_ms']:>14.2f}")
    base = rows[0]["tok_s"]
    for r in rows[1:]:
        print(f"TP={r['tp']}: {r['tok_s'] / base:.2f}x the output throughput of TP={rows[0]['tp']}")


if __name__ == "__main__":
    main()
