"""The step seam on the wire (the multi-process executor): values with numpy arrays round-trip."""

from __future__ import annotations

import numpy as np

from engine.step_io import CachedRequestData, ModelRunnerOutput, SchedulerOutput, step_decoder, step_encoder


def test_scheduler_output_with_grammar_bitmasks_round_trips() -> None:
    masks = {"a": np.arange(12, dtype=np.int32).reshape(2, 6), "b": np.full((1, 3), -1, dtype=np.int32)}
    so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"a": 2, "b": 1},
                         total_num_scheduled_tokens=3, finished_req_ids=set(), grammar_bitmask=masks)
    back = step_decoder(SchedulerOutput).decode(step_encoder().encode(so))
    assert back.num_scheduled_tokens == {"a": 2, "b": 1}
    assert back.grammar_bitmask is not None and set(back.grammar_bitmask) == {"a", "b"}
    for key, mask in masks.items():
        got = back.grammar_bitmask[key]
        assert got.dtype == mask.dtype and got.shape == mask.shape and np.array_equal(got, mask)
        got[0, 0] = 7  # a writable copy, not a view of the message buffer


def test_model_runner_output_round_trips() -> None:
    out = ModelRunnerOutput(req_ids=["x"], sampled_token_ids=[[5, 6]])
    back = step_decoder(ModelRunnerOutput).decode(step_encoder().encode(out))
    assert back.req_ids == ["x"] and back.sampled_token_ids == [[5, 6]]
