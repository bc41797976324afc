"""TritonAttentionBackend (and the flash_attn / flashinfer adapters) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from test_triton_kernels import DEVICE, PagedBatch, assert_close  # noqa: E402

from engine.attention.backend import AttentionMetadata  # noqa: E402
from engine.attention.flash_backend import FlashAttnBackend, FlashInferBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
# Part of the GPU check (`pytest -m gpu`): compiled kernels on a GPU, the Triton interpreter on a CPU.
pytestmark = pytest.mark.gpu


def run_backend(backend, b: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    cache = b.kv_cache.clone()
    backend.begin_step(b.metadata)
    out = backend.forward(b.q, b.k, b.v, cache, b.metadata, b.scale)
    return out, cache


def test_is_available_on_cpu_follows_the_interpreter_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.is_available(cpu) == (True, "")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TritonAttentionBackend.is_available(cpu) == (False, "triton needs a GPU or TRITON_INTERPRET=1")


def test_flash_adapters_explain_why_they_are_unavailable_on_cpu() -> None:
    for cls, lib in ((FlashAttnBackend, "flash_attn"), (FlashInferBackend, "flashinfer")):
        ok, reason = cls.is_available(torch.device("cpu"))
        assert not ok
        assert reason in (f"{lib} is not installed", f"{lib} needs a CUDA GPU")


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [([3, 17, 33], [1, 1, 1]), ([12, 1, 26, 9], [12, 1, 6, 1])],
    ids=["pure_decode", "mixed_with_prefix_hit"],
)
def test_forward_matches_torch_backend(seq_lens: list[int], query_lens: list[int]) -> None:
    b = PagedBatch(seq_lens, query_lens, dtype=torch.float16)
    expected, expected_cache = b.reference()
    out, cache = run_backend(TritonAttentionBackend(decode_num_splits=2), b)
    assert_close(out, expected)
    assert torch.equal(cache, expected_cache)


def test_padding_rows_are_not_cached_and_come_back_zero() -> None:
    b = PagedBatch([9, 5], [4, 1], pad_tokens=3)
    expected, expected_cache = b.reference()
    out, cache = run_backend(TritonAttentionBackend(), b)
    n = b.metadata.num_tokens
    assert_close(out[:n], expected)
    assert torch.count_nonzero(out[n:]) == 0
    assert torch.equal(cache, expected_cache)


def _step(prompt_q, prompt_k, prompt_v, start: int, end: int, block_table: torch.Tensor, bs: int):
    """Metadata + q/k/v of one request processing its tokens start..end-1 (a chunk or a decode)."""
    pos = torch.arange(start, end)
    slots = block_table[0, pos // bs].long() * bs + pos % bs
    md = AttentionMetadata(
        num_reqs=1,
        num_tokens=end - start,
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=DEVICE),
        slot_mapping=slots.to(DEVICE),
        block_table=block_table.to(DEVICE),
        max_query_len=end - start,
        max_seq_len=end,
        query_start_loc_cpu=[0, end - start],
        seq_lens_cpu=[end],
        block_size=bs,
    )
    return prompt_q[start:end], prompt_k[start:end], prompt_v[start:end], md


def test_chunked_prefill_then_decode_equals_one_shot_attention() -> None:
    """Two prefill chunks and three decode steps reproduce causal attention over the whole sequence."""
    gen = torch.Generator().manual_seed(3)
    total, bs, hkv, g, d = 23, 4, 2, 2, 16
    q = torch.randn(total, hkv * g, d, generator=gen).to(DEVICE)
    k = torch.randn(total, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(total, hkv, d, generator=gen).to(DEVICE)
    block_table = torch.randperm(8, generator=gen)[None, :].int()  # 8 blocks >= 23 / 4
    cache = torch.zeros(2, 8, bs, hkv, d, device=DEVICE)
    backend = TritonAttentionBackend()
    outs = []
    for start, end in [(0, 11), (11, 20), (20, 21), (21, 22), (22, 23)]:
        qs, ks, vs, md = _step(q, k, v, start, end, block_table, bs)
        backend.begin_step(md)
        outs.append(backend.forward(qs, ks, vs, cache, md, d**-0.5))
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, total, D]
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk, vv, is_causal=True, scale=d**-0.5
    ).transpose(0, 1)  # [total, Hq, D]
    assert_close(torch.cat(outs), expected)


@needs_cuda
@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, FlashAttnBackend, FlashInferBackend])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 300, 40, 1]], ids=["decode", "mixed"])
def test_gpu_backends_match_torch_at_llama_shapes(backend_cls, query_lens: list[int]) -> None:
    ok, reason = backend_cls.is_available(DEVICE)
    if not ok:
        pytest.skip(reason)
    seq_lens = [700, 300, 1500, 4000]
    b = PagedBatch(
        seq_lens, query_lens, num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16
    )
    expected, expected_cache = b.reference()
    out, cache = run_backend(backend_cls(), b)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache, expected_cache)


def test_flash_adapters_build_their_page_tables_from_the_block_table() -> None:
    """The library-independent half of the adapters: cache writes and per-step index tensors."""
    b = PagedBatch([9, 4, 6], [2, 4, 1], pad_tokens=1)
    _, expected_cache = b.reference()
    md, bs = b.metadata, b.metadata.block_size
    from engine.attention.flash_backend import write_kv_cache

    cache = b.kv_cache.clone()
    write_kv_cache(b.k, b.v, cache, md.slot_mapping, md.num_tokens)
    assert torch.equal(cache, expected_cache)

    fi = FlashInferBackend()
    fi.begin_step(md)
    indptr, indices, last_len = fi._page_table
    assert indptr.tolist() == [0, 3, 4, 6]
    bt = md.block_table.tolist()
    assert indices.tolist() == bt[0][:3] + bt[1][:1] + bt[2][:2]
    assert last_len.tolist() == [1, 4, 2]

    fa = FlashAttnBackend()
    fa.begin_step(md)  # block_size 4 < 256: contiguous gather path
    assert fa._cu_seqlens_k.tolist() == [0, 9, 13, 19]
    expected_slots = [bt[i][p // bs] * bs + p % bs for i, s in enumerate([9, 4, 6]) for p in range(s)]
    assert fa._gather_slots.tolist() == expected_slots


@pytest.mark.parametrize("backend_cls", [FlashAttnBackend, FlashInferBackend])
def test_flash_adapters_share_one_forward_around_the_library_call(backend_cls) -> None:  # type: ignore[no-untyped-def]
    """Dtype check, cache write before the library call, real rows only, padding rows zero: the part of
    forward that is not the library (whose call a stand-in replaces, so this runs on a CPU)."""

    class StandIn(backend_cls):  # type: ignore[misc, valid-type]
        def _attend(self, q, kv_cache, metadata, scale):  # type: ignore[no-untyped-def]
            self.seen = (q.clone(), kv_cache.clone(), scale)
            return 2 * q

    b = PagedBatch([9, 5], [4, 1], pad_tokens=3, dtype=torch.bfloat16)
    _, expected_cache = b.reference()
    backend = StandIn()
    out, cache = run_backend(backend, b)
    n = b.metadata.num_tokens
    q_seen, cache_seen, scale_seen = backend.seen
    assert torch.equal(q_seen, b.q[:n]) and scale_seen == b.scale  # the step's real tokens only
    assert torch.equal(cache_seen, expected_cache)  # K/V written before the library reads them
    assert torch.equal(out[:n], 2 * b.q[:n]) and torch.count_nonzero(out[n:]) == 0
    assert torch.equal(cache, expected_cache)
    with pytest.raises(ValueError, match=f"{backend_cls.name} supports float16/bfloat16 only"):
        run_backend(StandIn(), PagedBatch([3], [3]))
