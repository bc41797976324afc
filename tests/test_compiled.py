"""Compiled execution (enforce_eager=False): padding ladder, the attention custom op, the
piecewise split. Compiled-vs-reference greedy tokens on the real model: tests/test_oracle.py
(every scenario runs compiled and eager against HF transformers)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.sampling_params import SamplingParams
from engine.worker.compiled import decode_ladder, dummy_decode_metadata, padded_size, step_context


def test_decode_ladder_and_padding():
    assert decode_ladder(1) == [1]
    assert decode_ladder(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert decode_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    ladder = decode_ladder(48)
    assert [padded_size(n, ladder) for n in (1, 3, 5, 33, 48)] == [1, 4, 8, 48, 48]
    assert padded_size(49, ladder) is None


def _decode_metadata(seq_lens: list[int], block_size: int) -> AttentionMetadata:
    """One decode token per request; request i owns blocks [i * 2, i * 2 + 1]."""
    n = len(seq_lens)
    table = torch.tensor([[2 * i, 2 * i + 1] for i in range(n)], dtype=torch.int32)
    slots = torch.tensor([table[i, (s - 1) // block_size] * block_size + (s - 1) % block_size
                          for i, s in enumerate(seq_lens)], dtype=torch.int64)  # fmt: skip
    return AttentionMetadata(
        num_reqs=n, num_tokens=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), slot_mapping=slots, block_table=table,
        max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens, block_size=block_size,
    )  # fmt: skip


def test_attention_op_ignores_padding_rows():
    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 8
    md = _decode_metadata([3, 7, 5], bs)
    cache = torch.randn(2, 8, bs, hkv, d)
    q, k, v = torch.randn(5, hq, d), torch.randn(5, hkv, d), torch.randn(5, hkv, d)  # 3 real rows + 2 pad
    ref_backend, op_backend = TorchAttentionBackend(), TorchAttentionBackend()
    ref_cache, op_cache = cache.clone(), cache.clone()
    ref_backend.begin_step(md)
    expected = ref_backend.forward(q[:3], k[:3], v[:3], ref_cache, md, d**-0.5)
    op_backend.begin_step(md)
    with step_context(op_backend, md, [op_cache]):
        got = torch.ops.servelab.layer_attention(q, k, v, 0, d**-0.5)
    assert got.shape == q.shape
    torch.testing.assert_close(got[:3], expected)
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))
    assert torch.equal(op_cache, ref_cache)  # padding wrote nothing into the cache


def test_attention_op_outside_a_step_is_a_clear_error():
    x = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="outside step_context"):
        torch.ops.servelab.layer_attention(x, x, x, 0, 1.0)


def test_dummy_metadata_is_a_valid_decode_batch():
    md = dummy_decode_metadata(4, 16, torch.device("cpu"))
    assert md.is_pure_decode and md.num_tokens == 4 and md.block_table.shape == (4, 1)


def _tiny_llm(enforce_eager: bool, **kw):
    """float32 unless told: compiled and eager are compared at float32 tolerances."""
    from engine.frontend.llm import LLM

    kw.setdefault("dtype", "float32")
    return LLM(model="smollm2", load_format="dummy", num_layers_override=2, max_num_seqs=4, num_blocks=64,
               enforce_eager=enforce_eager, **kw)


def test_eager_default_runs_no_compiled_step():
    llm = _tiny_llm(True)
    assert llm.engine_core.executor.model_runner.compiled is None
    assert llm.engine_core.executor.compile_time == 0.0
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.step_stats and not any(s.compiled for s in llm.step_stats)
    assert all(s.padded_tokens == s.num_prefill_tokens + s.num_decode_tokens for s in llm.step_stats)


def test_piecewise_split_matches_eager_on_cpu():
    """The GPU path's graph split at attention, run without capture (no CUDA needed)."""
    from engine.worker.compiled import route_attention_through_op
    from engine.worker.cuda_graphs import piecewise_backend, split_at_attention

    llm = _tiny_llm(True)
    runner = llm.engine_core.executor.model_runner
    model, backend, caches = runner.model, runner.attn_backend, runner.kv_caches
    assert route_attention_through_op(model, backend) == 2
    md = _decode_metadata([3, 7, 5], 16)
    ids, pos = torch.tensor([5, 6, 7]), torch.tensor([2, 6, 4])
    splits: list[list[str]] = []

    def recording_backend(gm, example_inputs):
        splits.append(split_at_attention(gm)[1])
        return piecewise_backend(capture=False)(gm, example_inputs)

    compiled = torch.compile(model, backend=recording_backend, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        backend.begin_step(md)
        with step_context(backend, md, [c.clone() for c in caches]):
            expected = model(ids, pos, caches, md)
        with step_context(backend, md, [c.clone() for c in caches]):
            got = compiled(ids, pos, caches, md)
    assert len(splits) == 1 and len(splits[0]) == 2  # one attention submodule per layer
    torch.testing.assert_close(got, expected)


def test_cuda_graph_module_imports_without_cuda():
    import engine.worker.cuda_graphs as cg

    assert cg.ATTENTION_OP == "servelab.layer_attention"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_graphs_match_eager_on_gpu():
    from engine.frontend.llm import LLM

    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model="smollm2", dtype="float32", device="cuda", max_num_seqs=4, num_blocks=64, enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            assert any(s.compiled for s in llm.step_stats)
    assert outs[True] == outs[False]
