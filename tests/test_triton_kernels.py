"""Triton paged-attention kernels against the torch reference backend.

On a machine without a GPU the kernels run in Triton's CPU interpreter, which
must be switched on before the kernels are defined (hence the env var before the
kernel import). Shapes stay tiny: the interpreter costs milliseconds per loop step.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from engine.attention.backend import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_kernels import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference_gqa_ragged(dtype: torch.dtype, num_splits: int) -> None:
    seq_lens = [1, 9, 17, 40]  # one token, within a block, across blocks, several splits
    b = PagedBatch(seq_lens, [1] * 4, dtype=dtype, seed=num_splits)
    expected, cache = b.reference()
    out = torch.empty_like(b.q)
    md = b.metadata
    paged_decode_attention(
        b.q, cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_seq_len, b.scale, out,
        num_splits=num_splits,
    )  # fmt: skip
    assert_close(out, expected)


def test_decode_non_power_of_two_group_and_head_dim() -> None:
    b = PagedBatch([5, 23], [1, 1], num_kv_heads=1, group=3, head_dim=24, block_size=16)
    expected, cache = b.reference()
    out = torch.empty_like(b.q)
    md = b.metadata
    paged_decode_attention(
        b.q,
        cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_seq_len,
        b.scale,
        out,
        num_splits=2,
    )
    assert_close(out, expected)


PREFILL_CASES = {
    "fresh": ([6, 13], [6, 13]),
    "prefix_hit": ([21, 9], [7, 9]),  # request 0: 14 cached tokens, 7 new
    "mixed": ([10, 1, 18, 30], [10, 1, 5, 1]),  # prefill, decode, chunk over a prefix, decode
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_matches_reference(dtype: torch.dtype, case: str) -> None:
    seq_lens, query_lens = PREFILL_CASES[case]
    b = PagedBatch(seq_lens, query_lens, dtype=dtype)
    expected, cache = b.reference()
    out = torch.empty_like(b.q)
    md = b.metadata
    paged_prefill_attention(
        b.q, cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len, b.scale, out
    )
    assert_close(out, expected)


def test_prefill_group_not_dividing_tile_rows() -> None:
    # G = 3 with 16-row tiles: 5 query tokens per tile, the 16th row is idle.
    b = PagedBatch([12, 20], [12, 8], num_kv_heads=1, group=3, head_dim=24, block_size=16)
    expected, cache = b.reference()
    out = torch.empty_like(b.q)
    md = b.metadata
    paged_prefill_attention(
        b.q,
        cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_query_len,
        b.scale,
        out,
        block_m=16,
    )
    assert_close(out, expected)


def test_bfloat16_decode_and_prefill() -> None:
    b = PagedBatch([14, 11], [1, 6], dtype=torch.bfloat16)
    expected, cache = b.reference()
    md = b.metadata
    out = torch.empty_like(b.q)
    paged_prefill_attention(
        b.q, cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len, b.scale, out
    )
    assert_close(out, expected)
    d = PagedBatch([14, 11], [1, 1], dtype=torch.bfloat16, seed=1)
    expected, cache = d.reference()
    out = torch.empty_like(d.q)
    md = d.metadata
    paged_decode_attention(
        d.q,
        cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_seq_len,
        d.scale,
        out,
        num_splits=2,
    )
    assert_close(out, expected)


def test_choose_num_splits_fills_the_device_but_not_below_min_split() -> None:
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 33
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=512, num_sms=132) == 2
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=10**6, num_sms=132) == 64
