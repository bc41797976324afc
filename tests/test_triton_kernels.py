"""Triton paged-attention kernels against the torch reference backend.

On a machine without a GPU the kernels run in Triton's CPU interpreter, which
must be switched on before the kernels are defined (hence the env var before the
kernel import). Shapes stay tiny: the interpreter costs milliseconds per loop step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402

from engine.attention.backend import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_kernels import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)
from engine.attention.triton_kernels.paged_softmax import paged_online_softmax  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Part of the GPU check (`pytest -m gpu`): compiled kernels on a GPU, the Triton interpreter on a CPU.
pytestmark = pytest.mark.gpu
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


class PagedBatch:
    """A random step: packed q/k/v, a paged cache holding random cached prefixes, metadata.

    Physical blocks are shuffled so that logical neighbours are not physical neighbours.
    """

    def __init__(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        *,
        num_kv_heads: int = 2,
        group: int = 2,
        head_dim: int = 16,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        pad_tokens: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 3
        perm = torch.randperm(num_blocks, generator=gen)
        block_table = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
        slots: list[int] = []
        used = 0
        for i, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
            block_table[i, : blocks_per_req[i]] = perm[used : used + blocks_per_req[i]]
            used += blocks_per_req[i]
            slots += [
                int(block_table[i, p // block_size]) * block_size + p % block_size for p in range(s - ql, s)
            ]
        qsl = [0]
        for ql in query_lens:
            qsl.append(qsl[-1] + ql)
        n = qsl[-1]
        slots += [-1] * pad_tokens

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

        self.q = rand(n + pad_tokens, num_kv_heads * group, head_dim)  # [T, Hq, D]
        self.k = rand(n + pad_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
        self.v = rand(n + pad_tokens, num_kv_heads, head_dim)
        self.kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
        self.scale = head_dim**-0.5
        self.metadata = AttentionMetadata(
            num_reqs=len(seq_lens),
            num_tokens=n,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            block_table=block_table.to(DEVICE),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
        )

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [num_tokens, Hq, D], cache after the write) from the torch backend."""
        md, n = self.metadata, self.metadata.num_tokens
        unpadded = AttentionMetadata(**{**md.__dict__, "slot_mapping": md.slot_mapping[:n]})
        ref = TorchAttentionBackend()
        ref.begin_step(unpadded)
        cache = self.kv_cache.clone()
        out = ref.forward(self.q[:n], self.k[:n], self.v[:n], cache, unpadded, self.scale)
        return out, cache


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reshape_and_cache_writes_by_slot_and_skips_padding(dtype: torch.dtype) -> None:
    b = PagedBatch([7, 3], [5, 3], dtype=dtype, pad_tokens=2)
    _, expected = b.reference()
    cache = b.kv_cache.clone()
    reshape_and_cache(b.k, b.v, cache, b.metadata.slot_mapping)
    # Bit-exact: the two padding rows (slot -1) must not land anywhere.
    assert torch.equal(cache, expected)
    assert not torch.equal(cache, b.kv_cache)


def run_decode(b: PagedBatch, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode kernel output, torch reference) of batch `b` (one query token per sequence)."""
    expected, cache = b.reference()
    out = torch.empty_like(b.q)
    md = b.metadata
    paged_decode_attention(
        b.q, cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_seq_len, b.scale, out, **kwargs
    )
    return out, expected


def run_prefill(b: PagedBatch, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill kernel output, torch reference) of batch `b`."""
    expected, cache = b.reference()
    out = torch.empty_like(b.q)
    md = b.metadata
    paged_prefill_attention(
        b.q, cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len, b.scale, out, **kwargs
    )
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference_gqa_ragged(dtype: torch.dtype, num_splits: int) -> None:
    seq_lens = [1, 9, 17, 40]  # one token, within a block, across blocks, several splits
    b = PagedBatch(seq_lens, [1] * 4, dtype=dtype, seed=num_splits)
    assert_close(*run_decode(b, num_splits=num_splits))


def test_decode_non_power_of_two_group_and_head_dim() -> None:
    b = PagedBatch([5, 23], [1, 1], num_kv_heads=1, group=3, head_dim=24, block_size=16)
    assert_close(*run_decode(b, num_splits=2))


PREFILL_CASES = {
    "fresh": ([6, 13], [6, 13]),
    "prefix_hit": ([21, 9], [7, 9]),  # request 0: 14 cached tokens, 7 new
    "mixed": ([10, 1, 18, 30], [10, 1, 5, 1]),  # prefill, decode, chunk over a prefix, decode
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_matches_reference(dtype: torch.dtype, case: str) -> None:
    seq_lens, query_lens = PREFILL_CASES[case]
    assert_close(*run_prefill(PagedBatch(seq_lens, query_lens, dtype=dtype)))


def test_prefill_group_not_dividing_tile_rows() -> None:
    # G = 3 with 16-row tiles: 5 query tokens per tile, the 16th row is idle.
    b = PagedBatch([12, 20], [12, 8], num_kv_heads=1, group=3, head_dim=24, block_size=16)
    assert_close(*run_prefill(b, block_m=16))


def test_bfloat16_decode_and_prefill() -> None:
    assert_close(*run_prefill(PagedBatch([14, 11], [1, 6], dtype=torch.bfloat16)))
    assert_close(*run_decode(PagedBatch([14, 11], [1, 1], dtype=torch.bfloat16, seed=1), num_splits=2))


# ---- the shared paged online-softmax loop, on its own -----------------------------------------


@triton.jit
def _online_softmax_probe(
    q_ptr, q_pos_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, acc_ptr, m_ptr, l_ptr,
    start, end, qk_scale, stride_cb, stride_cs, stride_ch, block_size, kv_head,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + r[:, None] * BLOCK_D + d[None, :])
    acc, m_i, l_i = paged_online_softmax(
        q, tl.load(q_pos_ptr + r), key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head * stride_ch,
        start, end, qk_scale, stride_cb, stride_cs, block_size,
        ROWS=ROWS, HEAD_DIM=BLOCK_D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, UPCAST=True,
        DOT_PRECISION="ieee",
    )  # fmt: skip
    tl.store(acc_ptr + r[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(m_ptr + r, m_i)
    tl.store(l_ptr + r, l_i)


@pytest.mark.parametrize(("start", "end", "causal"), [(0, 37, True), (8, 37, False), (5, 5, False)],
                         ids=["causal", "split", "empty"])  # fmt: skip
def test_paged_online_softmax_partials_match_torch(start: int, end: int, causal: bool) -> None:
    """The jitted loop both kernels call: unnormalised acc, running max and sum (log2 domain)."""
    gen = torch.Generator().manual_seed(7)
    rows, dim, bs, hkv, kv_head, qk_scale = 16, 16, 8, 2, 1, 0.3
    num_blocks = 6  # 40 positions
    cache = torch.randn(2, num_blocks, bs, hkv, dim, generator=gen)
    block_table = torch.randperm(num_blocks, generator=gen).int()
    q = torch.randn(rows, dim, generator=gen)
    q_pos = torch.randint(start, max(end, start + 1), (rows,), generator=gen).int()
    if causal:
        q_pos[0] = start  # a row that sees a single position
    acc = torch.empty(rows, dim)
    m = torch.empty(rows)
    l_sum = torch.empty(rows)
    key, value = cache[0], cache[1]
    dev = [t.to(DEVICE) for t in (q, q_pos, key, value, block_table, acc, m, l_sum)]
    _online_softmax_probe[(1,)](
        *dev, start, end, qk_scale, key.stride(0), key.stride(1), key.stride(2), bs, kv_head,
        ROWS=rows, BLOCK_D=dim, BLOCK_N=16, CAUSAL=causal,
    )  # fmt: skip
    acc, m, l_sum = (t.cpu() for t in dev[5:])
    pos = torch.arange(start, end)
    keys = key[block_table[pos // bs].long(), pos % bs, kv_head]  # [end - start, D]
    values = value[block_table[pos // bs].long(), pos % bs, kv_head]
    s = (q @ keys.T) * qk_scale  # [rows, end - start]
    if causal:
        s = s.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
    m_ref = s.max(dim=1).values if end > start else torch.full((rows,), float("-inf"))
    p = torch.exp2(s - m_ref[:, None])
    torch.testing.assert_close(m, m_ref)
    torch.testing.assert_close(l_sum, p.sum(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acc, p @ values, atol=1e-4, rtol=1e-4)


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.attention.triton_kernels.decode_attention import _decode_split_kernel
from engine.attention.triton_kernels.prefill_attention import _prefill_kernel

def signature(fn, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if any(w in name for w in ("table", "lens", "loc")) else "*bf16"
        else:
            sig[name] = "i32"
    sig["qk_scale"] = "fp32"
    return sig

target = GPUTarget("cuda", 90, 32)  # an H100 / H200
for fn, consts in [
    (_decode_split_kernel, dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, SINGLE_SPLIT=False,
                                UPCAST=False, DOT_PRECISION="tf32")),
    (_prefill_kernel, dict(GROUP=4, BLOCK_Q=16, BLOCK_M=64, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, UPCAST=False,
                           DOT_PRECISION="tf32")),
]:
    kernel = triton.compile(ASTSource(fn, signature(fn, consts), consts), target=target)
    assert kernel.asm["cubin"], fn.__name__
    print(fn.__name__, "compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real Triton compiler (not the interpreter) builds both kernels for sm_90, Llama shapes, bf16.

    The interpreter accepts what a GPU compile rejects (a tl.dot whose K side is under 16, as
    BLOCK_N = 8 would give: "K >= 16"): this runs the whole lowering down to ptxas, which ships
    inside the triton wheel, on any machine.
    """
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"triton's bundled ptxas is missing ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_decode_split_kernel compiled" in done.stdout and "_prefill_kernel compiled" in done.stdout


def test_choose_num_splits_fills_the_device_but_not_below_min_split() -> None:
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 33
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=512, num_sms=132) == 2
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=10**6, num_sms=132) == 64
