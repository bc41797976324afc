"""Offline throughput of an 8B shape on a GPU, read against the weight-read floor.

    python benchmarks/gpu_offline.py [--model llama-3-8b] [--backend triton] [--batches 1,64,256]
        [--prompt-len 128] [--output-len 128] [--peak-bw-gbs 4800] [--json OUT] [--dry-run]

Model: a packaged model shape (`engine/model/shapes/<model>.yaml`) with dummy (random) weights in bfloat16 on `cuda`.
For each batch size B, B prompts of `prompt_len` token ids, greedy, ignore_eos,
`output_len` tokens each, all given to `LLM.generate` at once (after a short warm-up
that compiles the kernels). Figures per batch:
  decode_step_ms   median time of the steps that only decode (the engine's own step_time;
                   the sampler's host copy synchronises every step, so it is GPU time too)
  output_tok_s     output tokens / wall time of the whole generate (prefill included)
  decode_tok_s     B / decode_step_ms
  floor_ms         bytes a decode step must read (every weight but the embedding table, plus
                   the KV cache of the batch at mid-generation) / the device's peak bandwidth
  frac_peak        floor_ms / decode_step_ms: the fraction of the memory-bandwidth limit reached
Batch 1 is the latency figure (decode_step_ms vs the weight-read time); the large batches
are the throughput figures. The JSON file is rewritten after every batch, so a run stopped
by a time limit keeps what it measured. `--dry-run` builds nothing on a GPU: it resolves the
model shape and prints the plan (used by scripts/gpu_check.sh --dry-run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BW_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a model shape name (engine/model/shapes; dummy weights)")
    p.add_argument("--backend", default="triton", help="attention backend")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-gb", type=float, default=24.0)
    p.add_argument("--peak-bw-gbs", type=float, default=None, help="default: from the device name")
    p.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    p.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    return p.parse_args(argv)


def decode_read_bytes(arch: Any, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """Bytes one decode step reads: every weight but the embedding table, and the batch's KV."""
    weights = arch.num_parameters() - arch.vocab_size * arch.hidden_size  # the lookup reads B rows only
    kv = batch * context * 2 * arch.num_layers * arch.kv_size
    return (weights + kv) * dtype_bytes


def run_batch(llm: Any, batch: int, args: argparse.Namespace, arch: Any, peak: float | None) -> dict:
    from engine.sampling_params import SamplingParams

    prompts = [[(1000 + 7 * i + j) % arch.vocab_size for j in range(args.prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.step_stats.clear()
    llm.reset_prefix_cache()  # distinct prompts anyway; no hit from an earlier batch
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    decode = [s.step_time * 1e3 for s in llm.step_stats if s.num_prefill_tokens == 0 and s.num_decode_tokens]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    row: dict[str, Any] = {"batch": batch, "output_tokens": produced, "wall_s": round(wall, 3)}
    row["output_tok_s"] = round(produced / wall, 1)
    if decode:
        ms = statistics.median(decode)
        row |= {
            "decode_steps": len(decode),
            "decode_step_ms": round(ms, 3),
            "decode_tok_s": round(batch / ms * 1e3, 1),
        }
        if peak:
            floor = (
                decode_read_bytes(arch, batch, args.prompt_len + args.output_len // 2) / (peak * 1e9) * 1e3
            )
            row |= {"floor_ms": round(floor, 3), "frac_peak": round(floor / ms, 3)}
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.model.loader import read_shape
    from engine.model.source import resolve_source

    source = resolve_source(args.model)
    if source.kind != "shape":
        print(f"gpu_offline: --model must name a model shape (engine/model/shapes, dummy weights), got {args.model!r}")
        return 2
    arch = read_shape(source.path)
    batches = [int(b) for b in args.batches.split(",")]
    weights_gb = decode_read_bytes(arch, 0, 0) / 1e9
    print(
        f"model {args.model}: {arch.num_parameters() / 1e9:.2f} B params, {weights_gb:.1f} GB read per decode step (bf16)"
    )
    if args.dry_run:
        print(
            f"plan: backend {args.backend}, batches {batches}, prompt {args.prompt_len}, output {args.output_len}"
        )
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_offline: needs a CUDA GPU (use --dry-run to check the plan)")
        return 2
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    name = torch.cuda.get_device_name()
    peak = args.peak_bw_gbs or next((bw for key, bw in PEAK_BW_GBS.items() if key in name), None)
    res: dict[str, Any] = {
        "device": name, "peak_bw_gbs": peak, "model": args.model, "backend": args.backend,
        "weights_read_gb": round(weights_gb, 2), "prompt_len": args.prompt_len,
        "output_len": args.output_len, "rows": [],
    }  # fmt: skip
    if peak:
        res["weight_read_ms"] = round(weights_gb / peak * 1e3, 3)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model, load_format="dummy", dtype="bfloat16", device="cuda", attention_backend=args.backend,
        max_num_seqs=max(batches), max_num_batched_tokens=8192, kv_cache_memory_gb=args.kv_cache_gb,
    )  # fmt: skip
    res["load_s"] = round(time.perf_counter() - t0, 1)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[1] * 64, [2] * 16], warm, use_tqdm=False)  # compile the kernels
    for b in batches:
        row = run_batch(llm, b, args, arch, peak)
        res["rows"].append(row)
        print(json.dumps(row))
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
