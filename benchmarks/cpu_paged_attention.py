"""The C++ paged-attention op against the torch (gather + SDPA) path, one layer, on the CPU.

    python benchmarks/cpu_paged_attention.py [--threads 1] [--iters 20] [--layers 30]

SmolLM2 attention shape (9 query heads, 3 kv heads, head_dim 64, block 16), float32 and
bfloat16, three cases: decode (64 requests x 1 query token over 192 cached tokens), prefill
over a cached context (4 requests x 64-token chunks after 128 cached tokens: later chunks,
prefix hits) and fresh prefills (4 x 128 tokens, no cached context: SDPA `is_causal` on this
step's keys, against the op reading them back from the cache). Prints the median process CPU
time per call of each (steadier than wall time on a shared machine) and the ratio. Then, where
the CPU has AMX, a bfloat16 prefill step as the engine meets it on workload W (15 fresh prompts
of 96-160 tokens): the AMX prefill op against SDPA once per prompt (wall time).
`--layers N` times only the decode case as the model meets it, cold: N caches (one per layer)
read in turn, wall time per layer and GB/s of keys and values read; where the CPU has AMX,
bfloat16 on the AMX path and on the AVX-512 path.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention.torch_backend import gather_context  # noqa: E402
from engine.kernels.paged_attention import (  # noqa: E402
    paged_attention_op,
    paged_prefill_attention_op,
    set_amx_attention,
)

HQ, HKV, D, BS = 9, 3, 64, 16


def cpu_time(fn: Callable[[], object], iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        c0 = time.process_time()
        fn()
        ts.append(time.process_time() - c0)
    return sorted(ts)[len(ts) // 2]


def case(name: str, dtype: torch.dtype, batch: int, q_len: int, ctx: int, iters: int) -> None:
    seq = ctx + q_len
    nblk = -(-seq // BS)
    cache = torch.randn(2, batch * nblk, BS, HKV, D).to(dtype)
    table = torch.randperm(batch * nblk).view(batch, nblk)
    q = torch.randn(batch * q_len, HQ, D).to(dtype)
    qsl = torch.arange(batch + 1) * q_len
    lens = torch.full((batch,), seq)
    op = paged_attention_op()
    assert op is not None, "no C++ toolchain"
    scale = D**-0.5
    pos = torch.arange(seq)
    mask = pos[None, :] <= torch.arange(ctx, seq)[:, None]  # [q_len, seq]
    k_new = torch.randn(batch, q_len, HKV, D).to(dtype)
    v_new = torch.randn(batch, q_len, HKV, D).to(dtype)

    def torch_path() -> torch.Tensor:
        if ctx == 0:  # fresh prefill: SDPA is_causal over this step's own keys / values
            qb = q.view(batch, q_len, HQ, D).transpose(1, 2)
            return F.scaled_dot_product_attention(qb, k_new.transpose(1, 2), v_new.transpose(1, 2),
                                                  is_causal=True, scale=scale, enable_gqa=True)
        kv = gather_context(cache, table.reshape(-1), batch, seq)  # [2, B, seq, Hkv, D]
        qb = q.view(batch, q_len, HQ, D).transpose(1, 2)
        m = mask if q_len > 1 else None
        return F.scaled_dot_product_attention(qb, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=m,
                                              scale=scale, enable_gqa=True)

    t_op = cpu_time(lambda: op(q, cache, table, qsl, lens, scale), iters)
    t_torch = cpu_time(torch_path, iters)
    print(f"{str(dtype):15s} {name:26s} C++ op {t_op * 1e3:8.3f} ms   torch path {t_torch * 1e3:8.3f} ms   "
          f"op/torch {t_op / t_torch:5.2f}", flush=True)


def cold_decode(dtype: torch.dtype, layers: int, batch: int, ctx: int, iters: int) -> None:
    """Decode as the model runs it: one cache per layer, each read once per step, so the keys and
    values come from memory, not from a cache that the previous call warmed (a step's KV is far
    larger than the last-level cache). Wall time per layer and the KV bytes read per second."""
    seq = ctx + 1
    nblk = -(-seq // BS)
    caches = [torch.randn(2, batch * nblk, BS, HKV, D).to(dtype) for _ in range(layers)]
    tables = [torch.randperm(batch * nblk).view(batch, nblk) for _ in range(layers)]
    q = torch.randn(batch, HQ, D).to(dtype)
    qsl, lens = torch.arange(batch + 1), torch.full((batch,), seq)
    op = paged_attention_op()
    assert op is not None, "no C++ toolchain"
    scale = D**-0.5

    def step() -> None:
        for cache, table in zip(caches, tables, strict=True):
            op(q, cache, table, qsl, lens, scale)

    step()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    per_layer = sorted(ts)[len(ts) // 2] / layers
    kv_bytes = 2 * batch * seq * HKV * D * caches[0].element_size()
    print(f"{str(dtype):15s} cold decode {batch} x 1 over {ctx}, {layers} layers: {per_layer * 1e3:7.3f} ms / layer  "
          f"({kv_bytes / per_layer / 1e9:5.1f} GB/s of KV)", flush=True)


def prefill_step(iters: int, num: int = 15, lo: int = 96, hi: int = 160) -> None:
    """A prefill step as the engine meets it on workload W (bfloat16): `num` fresh prompts of
    lo..hi tokens (seeded) packed back to back, their keys / values already in the paged cache.
    The torch path runs SDPA once per prompt (`is_causal`, the rows as strided views of the
    layer's qkv); the AMX op attends every prompt in one call (wall time, this process's threads)."""
    op = paged_prefill_attention_op()
    if op is None:
        print("prefill step: no C++ toolchain")
        return
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (num,), generator=gen).tolist()
    total = sum(lens)
    qkv = torch.randn(total, HQ + 2 * HKV, D, generator=gen).to(torch.bfloat16)
    q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
    needed = [-(-n // BS) for n in lens]
    cache = torch.zeros(2, sum(needed), BS, HKV, D, dtype=torch.bfloat16)
    table = torch.zeros(num, max(needed), dtype=torch.int64)
    start, block = 0, 0
    for i, n in enumerate(lens):
        table[i, : needed[i]] = torch.arange(block, block + needed[i])
        cache[0].view(-1, HKV, D)[block * BS : block * BS + n] = k[start : start + n]
        cache[1].view(-1, HKV, D)[block * BS : block * BS + n] = v[start : start + n]
        start, block = start + n, block + needed[i]
    starts = torch.tensor([0, *lens]).cumsum(0)[:-1]
    qlen = torch.tensor(lens)
    out = torch.empty(q.shape, dtype=q.dtype)
    scale = D**-0.5

    def per_prompt() -> None:
        for a, n in zip(starts.tolist(), lens, strict=True):
            F.scaled_dot_product_attention(q[a : a + n].transpose(0, 1)[None], k[a : a + n].transpose(0, 1)[None],
                                           v[a : a + n].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)

    if not op(out, q, cache, table, starts, qlen, qlen, scale):
        print("prefill step: no AMX on this CPU (amx_bf16), the engine runs SDPA per prompt")
        return
    t_op, t_sdpa = wall_time(lambda: op(out, q, cache, table, starts, qlen, qlen, scale), iters), wall_time(per_prompt, iters)
    print(f"torch.bfloat16  prefill step {num} x {lo}-{hi} ({total} tokens): AMX op {t_op * 1e3:7.3f} ms   "
          f"SDPA per prompt {t_sdpa * 1e3:7.3f} ms   op/torch {t_op / t_sdpa:5.2f}", flush=True)


def wall_time(fn: Callable[[], object], iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=0,
                   help="only the cold-cache decode case, over this many layers' caches (30: SmolLM2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.layers:
        if set_amx_attention(True):  # the AMX path against the AVX-512 path, same process
            print("AMX path:")
            cold_decode(torch.bfloat16, args.layers, 64, 191, args.iters)
            set_amx_attention(False)
            print("AVX-512 path:")
        for dtype in (torch.bfloat16, torch.float32):
            cold_decode(dtype, args.layers, 64, 191, args.iters)
        set_amx_attention(True)
        return
    for dtype in (torch.bfloat16, torch.float32):
        case("decode 64 x 1 over 192", dtype, 64, 1, 191, args.iters)
        case("prefill 4 x 64 after 128", dtype, 4, 64, 128, args.iters)
        case("fresh prefill 4 x 128", dtype, 4, 128, 0, args.iters)
    prefill_step(args.iters)


if __name__ == "__main__":
    main()
