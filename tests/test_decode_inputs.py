"""The persistent inputs of a CPU decode step of the batch's first rows (engine/worker/decode_inputs.py):
the same inputs as the batch holds, two sets alternating, None where a row would not sample, and
the same tokens from the engine with and without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.decode_inputs import LeadingDecodeInputs
from engine.worker.input_batch import InputBatch

BS = 4


def _batch() -> InputBatch:
    """Three requests in rows 0-2, each with its next token at its computed count (a decode step)."""
    b = InputBatch(4, 64, 16)
    params = SamplingParams(temperature=0.0)
    for i, (n, blocks) in enumerate([(5, [7, 2]), (9, [3, 11, 4]), (2, [9])]):
        tokens = [100 * (i + 1) + k for k in range(n + 1)]  # n computed, one more known
        assert b.add(f"r{i}", tokens, n, params, blocks, n) == i
    return b


def test_inputs_are_the_batchs_and_two_sets_alternate() -> None:
    b = _batch()
    lead = LeadingDecodeInputs(4, 16, BS)
    x = lead.prepare(b, 3)
    assert x is not None
    pos = b.num_computed[:3]
    assert x.positions.tolist() == pos.tolist() == [5, 9, 2]
    assert x.input_ids.tolist() == [b.token_ids[i, p] for i, p in enumerate(pos)] == [105, 209, 302]
    # slot = block_table[row, p // BS] * BS + p % BS
    assert x.metadata.slot_mapping.tolist() == [2 * BS + 1, 4 * BS + 1, 9 * BS + 2]
    md = x.metadata
    assert md.seq_lens.dtype == torch.int32 and md.seq_lens.tolist() == md.seq_lens_cpu == [6, 10, 3]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == [0, 1, 2, 3]
    assert (md.num_reqs, md.num_tokens, md.max_query_len, md.max_seq_len) == (3, 3, 1, 10)
    # the block table: the blocks each context needs, as many columns as the longest needs
    assert md.block_table.shape == (3, 3) and md.block_table[1].tolist() == [3, 11, 4]
    assert md.block_table[0, :2].tolist() == [7, 2] and md.block_table[2, 0].item() == 9
    one = md.one_row_each
    assert one is not None and one.seq_lens.dtype == torch.int64 and one.seq_lens.tolist() == [6, 10, 3]
    assert one.query_start_loc.tolist() == [0, 1, 2, 3]
    assert x.rows.tolist() == x.sample_idx.tolist() == x.logits_indices.tolist() == [0, 1, 2]
    # the next step writes the other set: this step's inputs stay as they are
    b.num_computed[:3] += 1
    b.append_blocks(2, [5])  # never read below: row 2 still needs one block
    y = lead.prepare(b, 3)
    assert y is not None and y.positions.tolist() == [6, 10, 3] and x.positions.tolist() == [5, 9, 2]
    assert y.input_ids.data_ptr() != x.input_ids.data_ptr()
    assert y.metadata.block_table.data_ptr() != x.metadata.block_table.data_ptr()
    z = lead.prepare(b, 3)  # the first set again: step N + 2 is prepared after step N has run
    assert z is not None and z.input_ids.data_ptr() == x.input_ids.data_ptr() and x.positions.tolist() == [6, 10, 3]
    with pytest.raises(ValueError):  # the cached row numbers are read only
        x.rows[0] = 5


def test_a_row_that_would_not_sample_takes_the_runners_path() -> None:
    b = _batch()
    b.append_token(1, 777)  # row 1 knows two tokens past its computed count: a prompt chunk of one
    lead = LeadingDecodeInputs(4, 16, BS)
    assert lead.prepare(b, 3) is None
    assert lead.prepare(b, 1) is not None  # row 0 alone still samples
    np.testing.assert_array_equal(b.num_computed[:3], [5, 9, 2])


@torch.inference_mode()
def test_the_engine_gives_the_same_tokens_with_and_without_them() -> None:
    """Greedy and seeded sampling, 1 and 3 requests: the same tokens, and the leading rows' path ran."""
    llm = LLM(model="smollm2", max_num_seqs=3, max_model_len=512)
    runner = llm.engine_core.executor.worker.model_runner  # type: ignore[attr-defined]
    lead = runner._leading
    assert lead is not None
    calls = [0]
    prepare = lead.prepare

    def counting(batch: InputBatch, r: int):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return prepare(batch, r)

    lead.prepare = counting
    prompts = [list(range(400 + 30 * i, 430 + 30 * i + 3 * i)) for i in range(3)]
    runs = []
    for on in (True, False):
        runner._leading = lead if on else None
        for params in (SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)):  # fmt: skip
            llm.reset_prefix_cache()
            for batch in (prompts[:1], prompts):
                runs.append([o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)])
    assert runs[:4] == runs[4:]
    assert calls[0] >= 4 * 11  # every decode step of each run with them on
