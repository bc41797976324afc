"""Request state machine and its derived counters."""

from __future__ import annotations

import pytest

from engine.core.kv_cache.hashing import hash_request_blocks, make_block_hasher
from engine.request import Request, RequestStatus, finish_reason, is_finished
from engine.sampling_params import SamplingParams
from engine.seam import FinishReason


def test_status_helpers() -> None:
    assert not any(
        is_finished(s) for s in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)
    )
    assert finish_reason(RequestStatus.FINISHED_STOPPED) is FinishReason.STOP
    assert finish_reason(RequestStatus.FINISHED_LENGTH_CAPPED) is FinishReason.LENGTH
    assert finish_reason(RequestStatus.FINISHED_ABORTED) is FinishReason.ABORT
    assert finish_reason(RequestStatus.FINISHED_ERROR) is FinishReason.ERROR
    with pytest.raises(ValueError, match="RUNNING"):
        finish_reason(RequestStatus.RUNNING)


def test_new_request_defaults_and_counters() -> None:
    params = SamplingParams(max_tokens=5)
    req = Request("r", [10, 11, 12], params, eos_token_id=2, arrival_time=3.0)
    assert req.status == RequestStatus.WAITING and not req.is_finished
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (3, 3, 0)
    assert req.max_tokens == 5 and req.num_cached_tokens == -1 and req.num_computed_tokens == 0
    assert (req.first_scheduled_time, req.first_token_time, req.finished_time) == (0.0, 0.0, 0.0)
    assert req.get_finish_reason() is None

    req.append_output_token_ids(20)
    req.append_output_token_ids([21, 22])
    assert req.output_token_ids == [20, 21, 22]
    assert req.all_token_ids == [10, 11, 12, 20, 21, 22] and req.prompt_token_ids == [10, 11, 12]
    assert req.num_tokens == 6 and req.num_output_tokens == 3

    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.is_finished and req.get_finish_reason() is FinishReason.LENGTH


def test_resolved_max_tokens_overrides_sampling_params() -> None:
    req = Request("r", [1], SamplingParams(max_tokens=None), eos_token_id=None, max_tokens=40)
    assert req.max_tokens == 40
    assert Request("q", [1], SamplingParams(max_tokens=None), None).max_tokens is None


def test_block_hashes_follow_appended_tokens() -> None:
    prompt = list(range(100, 130))  # 30 tokens: one full block of 16
    req = Request("r", prompt, SamplingParams(), eos_token_id=2, block_hasher=make_block_hasher(16))
    assert req.block_hashes == hash_request_blocks(prompt, 16)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7])
    assert len(req.block_hashes) == 1  # 31 tokens
    req.append_output_token_ids([8, 9])  # 33 tokens: block 1 is full
    assert req.block_hashes == hash_request_blocks(req.all_token_ids, 16)
    assert len(req.block_hashes) == 2


def test_block_hasher_attached_later_hashes_existing_blocks() -> None:
    req = Request("r", list(range(40)), SamplingParams(), None, cache_salt="s")
    assert req.block_hashes == []
    req.set_block_hasher(make_block_hasher(16))
    assert req.block_hashes == hash_request_blocks(list(range(40)), 16, cache_salt="s")
