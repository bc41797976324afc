"""One model step of the default model on the CPU, timed and profiled, per dtype (a micro-benchmark).

    python benchmarks/cpu_decode_step.py [--dtype bfloat16,float32] [--batch 64] [--context 192]
        [--prefill-query 0] [--iters 20] [--profile] [--threads N] [--no-prepack] [--attention cpp,sdpa]

Builds SmolLM2-135M (the real GGUF weights) with `engine.model.loader.load_model`, a paged KV
cache, and a step of `--batch` requests, each with `--context` tokens in the cache: a decode
step (one query token each), or with `--prefill-query Q` a step of prefill chunks of Q tokens
over that context. Times `forward` + `compute_logits` of the sampled rows (the model's share of
an engine step; no scheduler, no sampler) and prints ms / step, tokens/s and GEMM FLOP/s
reached, and the process CPU time per step (on a shared machine, with `--threads 1`, the
steadier figure for A/B comparisons). `--profile` prints torch.profiler's top ops (self CPU time) of the timed steps: the
fused kernels show as `servelab::*`. `--attention cpp,sdpa` alternates steps with and without the
C++ paged-attention op (A/B against the gather + SDPA path, same process). The CPU flags that decide the fast dtype are printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import torch_backend  # noqa: E402
from engine.attention.backend import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.kernels.isa import BF16_CPU_FLAGS, cpu_flags  # noqa: E402
from engine.model.loader import load_model  # noqa: E402

BLOCK = 16


def step_metadata(batch: int, context: int, q: int) -> AttentionMetadata:
    """`batch` requests whose first `context` tokens are cached; `q` new tokens each."""
    seq = context + q
    nblk = -(-seq // BLOCK)
    tables = torch.arange(batch * nblk, dtype=torch.int32).view(batch, nblk)
    qsl = [i * q for i in range(batch + 1)]
    pos = torch.arange(context, seq)
    slots = (tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(-1)
    return AttentionMetadata(
        num_reqs=batch, num_tokens=batch * q, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq, dtype=torch.int32), slot_mapping=slots, block_table=tables,
        max_query_len=q, max_seq_len=seq, query_start_loc_cpu=qsl, seq_lens_cpu=[seq] * batch, block_size=BLOCK,
    )


def run(dtype: str, args: argparse.Namespace) -> None:
    backend = TorchAttentionBackend()
    model = load_model(ModelConfig(dtype=dtype), backend, "cpu")
    packed = 0 if args.no_prepack else model.prepack()
    print(f"{dtype}: {packed} weight matrices prepacked for oneDNN")
    arch = model.arch
    q = max(1, args.prefill_query)
    md = step_metadata(args.batch, args.context, q)
    nblk = md.block_table.numel()
    caches = [torch.randn(2, nblk, BLOCK, arch.num_kv_heads, arch.head_dim).to(model.model.norm.weight.dtype)
              for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (md.num_tokens,))
    positions = torch.arange(args.context, args.context + q).repeat(args.batch)
    last = torch.tensor(md.query_start_loc_cpu[1:]) - 1

    def step() -> torch.Tensor:
        backend.begin_step(md)
        hidden = model(ids, positions, caches, md)
        return model.compute_logits(hidden[last])

    real_op = torch_backend.paged_attention_op
    modes = args.attention.split(",")

    def use(mode: str) -> None:
        torch_backend.paged_attention_op = real_op if mode == "cpp" else (lambda: None)  # type: ignore[assignment]

    with torch.inference_mode():
        for mode in modes:
            use(mode)
            for _ in range(2):
                step()
        wall: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.iters):  # modes alternate, so load changes hit each alike
            for mode in modes:
                use(mode)
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
        params = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)  # tied head = embed
        flops = 2 * params * md.num_tokens - 2 * arch.vocab_size * arch.hidden_size * (md.num_tokens - args.batch)
        for mode in modes:
            med = sorted(wall[mode])[len(wall[mode]) // 2]
            cpu_med = sorted(cpu[mode])[len(cpu[mode]) // 2]
            print(f"{dtype:9s} attention {mode:4s} batch {args.batch} x q {q} over {args.context}: wall median "
                  f"{med * 1e3:8.2f} ms/step ({md.num_tokens / med:7.1f} tok/s, {flops / med / 1e9:6.1f} GFLOP/s); "
                  f"CPU time median {cpu_med * 1e3:8.2f} ms/step ({flops / cpu_med / 1e9:6.1f} GFLOP per CPU-s)")
        use(modes[0])
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16,float32", help="comma-separated: float32, bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--prefill-query", type=int, default=0, help="Q > 0: a step of prefill chunks of Q tokens")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-prepack", action="store_true", help="keep plain weights (the engine's prepack_weights=false)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--attention", default="cpp", help="cpp | sdpa | cpp,sdpa (A/B, alternating steps)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    flags = sorted(cpu_flags() & {*BF16_CPU_FLAGS, "avx512f", "avx2", "amx_tile"})
    print(f"CPU flags: {' '.join(flags) or '(none of interest)'}; threads {torch.get_num_threads()}")
    for dtype in args.dtype.split(","):
        run(dtype, args)


if __name__ == "__main__":
    main()
