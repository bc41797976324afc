"""Attention kernel and backend benchmark: Triton paged kernels vs torch SDPA, FlashAttention, FlashInfer.

    python benchmarks/attention_kernels.py                  # full sweep on a CUDA GPU (< 8 min on an H200)
    python benchmarks/attention_kernels.py --interpret      # tiny CPU smoke run in the Triton interpreter

Three parts, each a table:
  decode   one query token per sequence over a paged bf16 cache (Llama-3-8B attention shape:
           32 query heads, 8 kv heads, head_dim 128, block 16) for batch x context; time, and
           achieved bandwidth (KV bytes + q/o bytes) / time as a fraction of the device peak.
  prefill  causal attention of fresh prompts (and one prefix hit); time and TFLOP/s.
  e2e      decode-step time of the engine (`engine.frontend.llm.LLM`, Llama-3-8B-shaped dummy weights) per
           attention backend, next to the weights-bytes / peak-bandwidth floor of a batch-1 step.
Baselines that are not installed, or fail, are reported as such and do not stop the sweep.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

PEAK_BW_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}
LLAMA3_8B_PARAMS = 8.03e9  # weights read once per decode step
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
L2_FLUSH_BYTES = 256 * 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="tiny smoke run on CPU (TRITON_INTERPRET=1)")
    p.add_argument("--peak-bw-gbs", type=float, default=None, help="device peak memory bandwidth, GB/s")
    p.add_argument("--batch-sizes", default="1,4,16,64,256")
    p.add_argument("--context-lens", default="512,2048,8192,32768")
    p.add_argument("--max-kv-tokens", type=int, default=4 * 1024 * 1024, help="skip larger decode configs")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--parts", default="decode,prefill,e2e")
    p.add_argument("--e2e-backends", default="torch,triton,flash_attn,flashinfer")
    p.add_argument("--out", default=None, help="write all rows to this CSV file")
    return p.parse_args(argv)


def peak_bandwidth(device_name: str, flag: float | None) -> float | None:
    """GB/s: the flag if given, else the table entry whose key is in the device name."""
    if flag is not None:
        return flag
    return next((bw for key, bw in PEAK_BW_GBS.items() if key in device_name), None)


def time_ms(fn: Callable[[], Any], iters: int, device: Any) -> float:
    """Median milliseconds of fn(), L2 flushed before each call on a GPU."""
    import torch

    fn()  # compile / warm up
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    for _ in range(2):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def try_time(fn_factory: Callable[[], Callable[[], Any]], iters: int, device: Any) -> float | str:
    """Time a baseline, or say why it could not run (missing library, unsupported shape)."""
    try:
        return round(time_ms(fn_factory(), iters, device), 4)
    except ImportError as e:
        return f"not installed ({e.name})"
    except Exception as e:  # a baseline failing must not stop the sweep
        return f"error: {type(e).__name__}: {str(e)[:80]}"


class PagedSetup:
    """Random paged cache and batch: num_seqs sequences of seq_len tokens, q_len queries each."""

    def __init__(
        self, num_seqs: int, seq_len: int, q_len: int, shape: tuple[int, int, int, int], device: Any
    ):
        import torch

        hq, hkv, d, bs = shape
        dt = torch.bfloat16
        self.blocks_per_seq = -(-seq_len // bs)
        num_blocks = num_seqs * self.blocks_per_seq
        self.kv_cache = torch.randn(2, num_blocks, bs, hkv, d, device=device, dtype=dt)
        perm = torch.randperm(num_blocks, device=device).int()
        self.block_table = perm.view(num_seqs, self.blocks_per_seq)  # [num_seqs, blocks_per_seq]
        self.q = torch.randn(num_seqs * q_len, hq, d, device=device, dtype=dt)  # [T, Hq, D]
        self.out = torch.empty_like(self.q)
        self.seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        self.qsl = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=device)
        self.num_seqs, self.seq_len, self.q_len, self.shape = num_seqs, seq_len, q_len, shape
        self.scale = d**-0.5

    def dense_kv(self) -> tuple[Any, Any]:
        """Contiguous copies [num_seqs, seq_len, Hkv, D] of the cache contents, for dense baselines."""
        hkv, d = self.shape[1], self.shape[2]
        k = self.kv_cache[0][self.block_table.long()].view(self.num_seqs, -1, hkv, d)[:, : self.seq_len]
        v = self.kv_cache[1][self.block_table.long()].view(self.num_seqs, -1, hkv, d)[:, : self.seq_len]
        return k.contiguous(), v.contiguous()

    def flashinfer_pages(self) -> tuple[Any, Any, Any]:
        import torch

        dev = self.kv_cache.device
        indptr = torch.arange(
            0, self.num_seqs * self.blocks_per_seq + 1, self.blocks_per_seq, device=dev
        ).int()
        last = torch.full(
            (self.num_seqs,), self.seq_len - (self.blocks_per_seq - 1) * self.shape[3], device=dev
        )
        return indptr, self.block_table.reshape(-1), last.int()


def decode_candidates(s: PagedSetup) -> dict[str, Callable[[], Callable[[], Any]]]:
    """name -> factory of a zero-argument callable running one decode over setup s."""
    import torch
    import torch.nn.functional as F

    def triton_fn():
        from engine.attention.triton_kernels import paged_decode_attention

        return lambda: paged_decode_attention(
            s.q, s.kv_cache, s.block_table, s.seq_lens, s.qsl, s.seq_len, s.scale, s.out
        )

    def sdpa_fn():
        k, v = s.dense_kv()
        q4 = s.q.view(s.num_seqs, 1, -1, s.shape[2]).transpose(1, 2)  # [B, Hq, 1, D]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
        return lambda: F.scaled_dot_product_attention(q4, kt, vt, scale=s.scale, enable_gqa=True)

    def flash_attn_fn():
        from flash_attn import flash_attn_with_kvcache

        k, v = s.dense_kv()
        q4 = s.q.view(s.num_seqs, 1, -1, s.shape[2])  # [B, 1, Hq, D]
        return lambda: flash_attn_with_kvcache(q4, k, v, cache_seqlens=s.seq_lens, softmax_scale=s.scale)

    def flashinfer_fn():
        import flashinfer

        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=s.q.device)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        hq, hkv, d, bs = s.shape
        w.plan(*s.flashinfer_pages(), hq, hkv, d, bs, q_data_type=s.q.dtype, sm_scale=s.scale)
        return lambda: w.run(s.q, (s.kv_cache[0], s.kv_cache[1]))

    return {"triton": triton_fn, "sdpa": sdpa_fn, "flash_attn": flash_attn_fn, "flashinfer": flashinfer_fn}


def prefill_candidates(s: PagedSetup) -> dict[str, Callable[[], Callable[[], Any]]]:
    import torch
    import torch.nn.functional as F

    def triton_fn():
        from engine.attention.triton_kernels import paged_prefill_attention

        return lambda: paged_prefill_attention(
            s.q, s.kv_cache, s.block_table, s.seq_lens, s.qsl, s.q_len, s.scale, s.out
        )

    def sdpa_fn():
        k, v = s.dense_kv()
        q4 = s.q.view(s.num_seqs, s.q_len, -1, s.shape[2]).transpose(1, 2)  # [B, Hq, Lq, D]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
        if s.q_len == s.seq_len:
            return lambda: F.scaled_dot_product_attention(
                q4, kt, vt, is_causal=True, scale=s.scale, enable_gqa=True
            )
        # Prefix hit: query j sits at position ctx + j (bottom-right aligned causal mask).
        ctx = s.seq_len - s.q_len
        pos = torch.arange(s.seq_len, device=s.q.device)
        mask = pos[None, :] <= (ctx + torch.arange(s.q_len, device=s.q.device))[:, None]  # [Lq, L]
        return lambda: F.scaled_dot_product_attention(
            q4, kt, vt, attn_mask=mask, scale=s.scale, enable_gqa=True
        )

    def flash_attn_fn():
        from flash_attn import flash_attn_varlen_func

        k, v = s.dense_kv()
        hkv, d = s.shape[1], s.shape[2]
        k2, v2 = k.view(-1, hkv, d), v.view(-1, hkv, d)  # [num_seqs * seq_len, Hkv, D]
        return lambda: flash_attn_varlen_func(
            s.q, k2, v2, s.qsl, s.cu_k, s.q_len, s.seq_len, softmax_scale=s.scale, causal=True
        )

    def flashinfer_fn():
        import flashinfer

        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=s.q.device)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        hq, hkv, d, bs = s.shape
        w.plan(
            s.qsl, *s.flashinfer_pages(), hq, hkv, d, bs, causal=True, sm_scale=s.scale, q_data_type=s.q.dtype
        )
        return lambda: w.run(s.q, (s.kv_cache[0], s.kv_cache[1]))

    return {"triton": triton_fn, "sdpa": sdpa_fn, "flash_attn": flash_attn_fn, "flashinfer": flashinfer_fn}


def decode_bytes(s: PagedSetup) -> int:
    """Bytes a decode must move: every cached K and V of every sequence, plus q read and o written."""
    hq, hkv, d, _ = s.shape
    return 2 * (s.num_seqs * s.seq_len * 2 * hkv * d + 2 * s.num_seqs * hq * d)


def prefill_flops(s: PagedSetup) -> float:
    """QK^T and PV multiply-adds over the causally visible keys (context + triangle)."""
    hq, _, d, _ = s.shape
    ctx = s.seq_len - s.q_len
    visible = s.q_len * ctx + s.q_len * (s.q_len + 1) / 2
    return 4.0 * s.num_seqs * visible * hq * d


def run_decode(args: argparse.Namespace, shape: tuple, device: Any, peak: float | None) -> list[dict]:
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for ctx in [int(x) for x in args.context_lens.split(",")]:
            if b * ctx > args.max_kv_tokens:
                continue
            s = PagedSetup(b, ctx, 1, shape, device)
            for name, factory in decode_candidates(s).items():
                ms = try_time(factory, args.iters, device)
                row = {"part": "decode", "batch": b, "context": ctx, "impl": name, "ms": ms}
                if isinstance(ms, float):
                    gbs = decode_bytes(s) / ms / 1e6
                    row |= {"GB/s": round(gbs, 1), "frac_peak": round(gbs / peak, 3) if peak else None}
                rows.append(row)
            del s
    return rows


def run_prefill(args: argparse.Namespace, shape: tuple, device: Any) -> list[dict]:
    # (num_seqs, seq_len, q_len): fresh prompts, then one chunk over a cached prefix.
    configs = [
        (1, 512, 512),
        (1, 2048, 2048),
        (1, 8192, 8192),
        (4, 2048, 2048),
        (16, 512, 512),
        (1, 8704, 512),
    ]
    if args.interpret:
        configs = [(1, 40, 40), (2, 40, 8)]
    rows = []
    for n, seq_len, q_len in configs:
        s = PagedSetup(n, seq_len, q_len, shape, device)
        for name, factory in prefill_candidates(s).items():
            ms = try_time(factory, args.iters, device)
            row = {"part": "prefill", "batch": n, "context": seq_len, "q_len": q_len, "impl": name, "ms": ms}
            if isinstance(ms, float):
                row["TFLOP/s"] = round(prefill_flops(s) / ms / 1e9, 1)
            rows.append(row)
    return rows


def run_e2e(args: argparse.Namespace, peak: float | None) -> list[dict]:
    """Median decode-step time of the engine per backend, batch 1 and 16, Llama-3-8B-shaped dummy model."""
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    floor_ms = LLAMA3_8B_PARAMS * 2 / (peak * 1e9) * 1e3 if peak else None
    rows = []
    for backend in args.e2e_backends.split(","):
        try:
            llm = LLM(model="llama-3-8b", load_format="dummy", attention_backend=backend, dtype="bfloat16")
        except Exception as e:
            rows.append({"part": "e2e", "impl": backend, "ms": f"error: {type(e).__name__}: {str(e)[:80]}"})
            continue
        for batch in (1, 16):
            llm.step_stats.clear()
            params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            llm.generate([[1] * 512 for _ in range(batch)], params, use_tqdm=False)
            steps = [st.step_time * 1e3 for st in llm.step_stats if st.num_prefill_tokens == 0]
            ms = statistics.median(steps) if steps else "no decode steps"
            row = {"part": "e2e", "batch": batch, "context": 512, "impl": backend, "ms": ms}
            if batch == 1 and floor_ms and isinstance(ms, float):
                row |= {"floor_ms": round(floor_ms, 2), "frac_peak": round(floor_ms / ms, 3)}
            rows.append(row)
        del llm
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU; use --interpret for a tiny CPU smoke run")
        return 0
    device = torch.device("cpu" if args.interpret else "cuda")
    name = "cpu (Triton interpreter)" if args.interpret else torch.cuda.get_device_name(device)
    peak = peak_bandwidth(name, args.peak_bw_gbs)
    shape = (Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    if args.interpret:
        shape = (4, 2, 32, 16)
        args.batch_sizes, args.context_lens, args.iters = "1,2", "32,64", 1
    parts = args.parts.split(",")
    print(
        f"device: {name}  peak bandwidth: {peak or 'unknown (pass --peak-bw-gbs)'} GB/s  shape(Hq,Hkv,D,block)={shape}"
    )
    rows: list[dict] = []
    if "decode" in parts:
        rows += run_decode(args, shape, device, peak)
    if "prefill" in parts:
        rows += run_prefill(args, shape, device)
    if "e2e" in parts and not args.interpret:
        rows += run_e2e(args, peak)
    report(rows, args.out)
    return 0


def report(rows: list[dict], out: str | None) -> None:
    import pandas as pd

    df = pd.DataFrame(rows)
    for part, table in df.groupby("part", sort=False):
        print(f"\n== {part} ==")
        print(table.dropna(axis=1, how="all").drop(columns="part").to_string(index=False))
    if out:
        df.to_csv(out, index=False)
        print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())
