"""Gemma 3 270M at batch 1: the decode step on the checkpoint's blocks against the dequantized float
weights, and where a step's time goes (issue 58 item 4).

    flock /tmp/servelab-bench.lock .venv/bin/python benchmarks/gemma3_decode_cost.py
        [--tokens 48] [--rounds 3] [--calls 20] [--dtype float32] [--json OUT]

tpot   `LLM.generate` of one prompt, greedy, ignore_eos: the wall time of 1 + `--tokens` tokens
       minus that of 1 token, over `--tokens` (no prefill in it), with `model.quantized_decode` off
       (every linear and the LM head multiply the loader's float weights) and on (the GGUF blocks:
       Q5_0 / Q8_0 / Q4_K / Q6_K layers, the Q8_0 LM head, engine/kernels/cpu_blocks.py). The two
       engines alternate round by round; the median of `--rounds`.
split  The pieces of one step, each the median of `--calls` calls on one row: the 262,144-row LM
       head (`compute_logits`, the final soft-cap included) on its Q8_0 blocks and on the float
       weight, with the bytes it streams and the GB/s that makes; the sampler over that
       vocabulary (`Sampler.sample` on the float32 logits: greedy, temperature 1, top-k 50,
       top-p 0.95), ids on the host.
The machine may be shared (compiles, tests): say so next to the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_blocks
from engine.kernels.isa import kernel_cpu_flags
from engine.sample.sampler import Sampler, SamplingBatch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def median_ms(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def tpot_ms(llm: LLM, tokens: int) -> float:
    """(wall of 1 + tokens tokens - wall of 1 token) / tokens, in ms."""

    def wall(n: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([PROMPT], sp, use_tqdm=False)
        return time.perf_counter() - t0

    return (wall(1 + tokens) - wall(1)) / tokens * 1e3


def split(model: torch.nn.Module, calls: int) -> dict[str, float]:
    """ms of one row's LM head on this model, and of the sampler over its logits."""
    hidden = torch.randn(1, model.arch.hidden_size)  # type: ignore[attr-defined]
    with torch.inference_mode():
        out = {"lm_head_ms": median_ms(lambda: model.compute_logits(hidden), calls)}  # type: ignore[operator]
        logits = model.compute_logits(hidden)  # type: ignore[operator]
    sampler = Sampler()
    for name, params in (("greedy", SamplingParams(temperature=0.0)), ("temperature_1", SamplingParams(temperature=1.0)),
                         ("top_k_50", SamplingParams(temperature=1.0, top_k=50)),
                         ("top_p_0.95", SamplingParams(temperature=1.0, top_p=0.95))):  # fmt: skip
        out[f"sampler_{name}_ms"] = median_ms(lambda p=params: sampler.sample(logits, SamplingBatch([p], [None])), calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.tokens < 1 or args.rounds < 1 or args.calls < 1:
        ap.error("--tokens, --rounds and --calls must be at least 1")
    common = dict(model="gemma3-270m", dtype=args.dtype, max_num_seqs=1, num_blocks=256, max_model_len=256)
    engines = {qd: LLM(quantized_decode=qd, **common) for qd in (False, True)}  # type: ignore[arg-type]
    tpots: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for qd, llm in engines.items():
            tpots[qd].append(tpot_ms(llm, args.tokens))
    result: dict[str, object] = {"cpu_flags": kernel_cpu_flags(), "threads": torch.get_num_threads(),
                                 "block_linear": cpu_blocks.isa(), "dtype": args.dtype, "tokens": args.tokens}  # fmt: skip
    for qd, name in ((False, "float"), (True, "blocks")):
        model = engines[qd].engine_core.executor.worker.model
        result[name] = {"tpot_ms": statistics.median(tpots[qd]), "tpot_rounds_ms": tpots[qd],
                        "step_weights": model.step_weights(), **split(model, args.calls)}  # fmt: skip
    vocab, hidden = engines[True].engine_core.executor.worker.model._lm_head_weight().shape
    head_bytes = {"float": vocab * hidden * torch.finfo(getattr(torch, args.dtype)).bits // 8,
                  "blocks": vocab * hidden // 32 * 34}  # fmt: skip
    for name, nbytes in head_bytes.items():
        entry = result[name]
        assert isinstance(entry, dict)
        entry["lm_head_mb"] = nbytes / 1e6
        entry["lm_head_gb_s"] = nbytes / entry["lm_head_ms"] / 1e6
    print(f"gemma3-270m batch 1, {args.dtype}, {result['threads']} threads, cpu flags {result['cpu_flags']}, "
          f"block_linear={result['block_linear']}")  # fmt: skip
    for name in ("float", "blocks"):
        e = result[name]
        assert isinstance(e, dict)
        print(f"  {name:6s} TPOT {e['tpot_ms']:6.2f} ms (rounds {', '.join(f'{t:.2f}' for t in e['tpot_rounds_ms'])}); "
              f"LM head {e['lm_head_ms']:6.2f} ms ({e['lm_head_mb']:.0f} MB, {e['lm_head_gb_s']:.1f} GB/s); sampler "
              + ", ".join(f"{k[8:-3]} {v:.2f} ms" for k, v in e.items() if k.startswith("sampler_")))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
