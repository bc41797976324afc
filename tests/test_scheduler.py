"""Scheduler behaviour driven with hand-made runner outputs (SCENARIOS 1-16, 20, 21, 27, 29).

Every test ends with `assert_idle()`: no request left, every block free, ref counts 0.
"""

from __future__ import annotations

from sched_utils import EOS, SAMPLED, fake_runner_output, make_request, make_scheduler, run_until_idle, step

from engine.core.sched.stats import KV_CONNECTOR_STATS
from engine.request import RequestStatus
from engine.seam import FinishReason
from engine.step_io import ModelRunnerOutput


def scheduled(out) -> dict[str, int]:  # noqa: ANN001
    return dict(out.num_scheduled_tokens)


# ---- admission, budget, chunking ------------------------------------------------


def test_waiting_queue_order_and_unfinished_count() -> None:
    sched = make_scheduler()
    reqs = [make_request(f"r{i}", 10) for i in range(4)]
    for i, r in enumerate(reqs):
        sched.add_request(r)
        assert sched.get_num_unfinished_requests() == i + 1
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2", "r3"]
    sched.abort_requests(["r1", "unknown"])
    assert sched.get_num_unfinished_requests() == 3 and sched.num_waiting == 3
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED
    sched.abort_requests(["r0", "r2", "r3"])
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"r0", "r1", "r2", "r3"}
    sched.assert_idle()


def test_one_step_admits_every_waiting_request_whole() -> None:
    sched = make_scheduler()
    for i, n in enumerate([10, 33, 7]):
        sched.add_request(make_request(f"r{i}", n))
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert scheduled(out) == {"r0": 10, "r1": 33, "r2": 7} and out.total_num_scheduled_tokens == 50
    assert [len(d.block_ids) for d in out.scheduled_new_reqs] == [1, 3, 1]
    assert out.num_prefill_tokens == 50 and out.num_decode_tokens == 0 and out.num_prefill_reqs == 3
    assert sched.num_running == 3 and sched.num_waiting == 0
    sched.update_from_output(out, fake_runner_output(sched, out))
    run_until_idle(sched)
    sched.assert_idle()


def test_long_prefill_threshold_splits_big_prompts() -> None:
    sched = make_scheduler(num_blocks=200, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 800, first_token=1000 * (i + 1)))
    out1, outs1 = step(sched)
    assert scheduled(out1) == {"a": 400, "b": 400, "c": 224} and outs1 == []
    out2, outs2 = step(sched)
    assert scheduled(out2) == {"a": 400, "b": 400, "c": 224}
    assert [o.request_id for o in outs2] == ["a", "b"]  # a and b sampled their first token
    assert [d.req_id for d in out2.scheduled_new_reqs] == []
    assert out2.scheduled_cached_reqs.num_computed_tokens == [400, 400, 224]
    out3, _ = step(sched)
    assert scheduled(out3) == {"a": 1, "b": 1, "c": 352}
    assert (out3.num_decode_tokens, out3.num_prefill_tokens) == (2, 352)
    assert (out3.num_decode_reqs, out3.num_prefill_reqs) == (2, 1)
    run_until_idle(sched)
    sched.assert_idle()


def test_partial_prefill_samples_nothing_then_gets_the_rest() -> None:
    sched = make_scheduler(max_num_batched_tokens=50)
    req = make_request("r", 80)
    sched.add_request(req)
    out1 = sched.schedule()
    assert scheduled(out1) == {"r": 50} and req.num_computed_tokens == 50
    # Even if a runner returned a token for the partial prefill, it is ignored.
    bogus = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[SAMPLED]])
    assert sched.update_from_output(out1, bogus) == [] and req.output_token_ids == []
    out2, outs2 = step(sched)
    assert scheduled(out2) == {"r": 30}
    assert out2.scheduled_cached_reqs.num_computed_tokens == [50]
    assert [o.new_token_ids for o in outs2] == [[SAMPLED]]
    out3, _ = step(sched)
    assert scheduled(out3) == {"r": 1} and out3.scheduled_cached_reqs.num_computed_tokens == [80]
    run_until_idle(sched)
    sched.assert_idle()


def test_without_chunked_prefill_the_head_blocks_shorter_prompts() -> None:
    def first_step(chunked: bool) -> dict[str, int]:
        sched = make_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=chunked)
        for rid, n, first in (("a", 60, 100), ("b", 80, 1000), ("c", 10, 2000)):
            sched.add_request(make_request(rid, n, first_token=first))
        out, _ = step(sched)
        run_until_idle(sched)
        sched.assert_idle()
        return scheduled(out)

    assert first_step(chunked=False) == {"a": 60}  # b does not fit; c may not overtake it
    assert first_step(chunked=True) == {"a": 60, "b": 40}


def test_without_chunking_a_prompt_over_the_whole_budget_is_chunked_anyway() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    sched.add_request(make_request("r", 50))
    assert [scheduled(step(sched)[0]) for _ in range(2)] == [{"r": 32}, {"r": 18}]
    run_until_idle(sched)
    sched.assert_idle()


# ---- stopping ---------------------------------------------------------------------


def test_eos_finishes_stopped_and_is_kept() -> None:
    sched = make_scheduler()
    req = make_request("r", 10, max_tokens=10)
    sched.add_request(req)
    step(sched)
    _, outs = step(sched, {"r": [EOS]})
    assert outs[0].new_token_ids == [EOS] and outs[0].finish_reason == FinishReason.STOP
    assert outs[0].stop_reason is None and outs[0].finished_time > 0
    assert req.output_token_ids == [SAMPLED, EOS] and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.num_running == 0 and "r" in sched.schedule().finished_req_ids
    sched.assert_idle()


def test_stop_token_sets_stop_reason_and_drops_later_tokens() -> None:
    sched = make_scheduler()
    req = make_request("r", 10, stop_token_ids=[42], logprobs=1)
    sched.add_request(req)
    out = sched.schedule()
    lps = [(t, -0.5, [(t, -0.5)]) for t in (5, 42, 6)]
    runner = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5, 42, 6]], logprobs={"r": lps})
    (o,) = sched.update_from_output(out, runner)
    assert o.new_token_ids == [5, 42] and o.stop_reason == 42 and o.finish_reason == FinishReason.STOP
    assert o.new_logprobs == lps[:2]
    assert req.output_token_ids == [5, 42]
    sched.assert_idle()


def test_max_tokens_caps_output() -> None:
    sched = make_scheduler()
    req = make_request("r", 10, max_tokens=3)
    sched.add_request(req)
    step(sched, {"r": [11, 12]})
    _, outs = step(sched, {"r": [13, 14, 15]})
    assert outs[0].new_token_ids == [13] and outs[0].finish_reason == FinishReason.LENGTH
    assert req.output_token_ids == [11, 12, 13] and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    sched.assert_idle()


def test_ignore_eos_and_min_tokens() -> None:
    sched = make_scheduler()
    free_run = make_request("free", 10, max_tokens=3, ignore_eos=True)
    patient = make_request("patient", 10, max_tokens=8, min_tokens=3, stop_token_ids=[42])
    sched.add_request(free_run)
    sched.add_request(patient)
    for _ in range(2):
        step(sched, {"free": [EOS], "patient": [EOS]})
    step(sched, {"free": [EOS], "patient": [42]})
    assert (
        free_run.output_token_ids == [EOS, EOS, EOS]
        and free_run.status == RequestStatus.FINISHED_LENGTH_CAPPED
    )
    # min_tokens=3: EOS twice ignored, the stop token as third output counts.
    assert patient.output_token_ids == [EOS, EOS, 42] and patient.stop_reason == 42
    assert patient.status == RequestStatus.FINISHED_STOPPED
    sched.assert_idle()


def test_stop_string_finish_from_the_front_end() -> None:
    # The detokenizer finds stop strings (text side); the scheduler finishes the request.
    sched = make_scheduler()
    req = make_request("r", 10)
    sched.add_request(req)
    step(sched)
    sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [SAMPLED]
    assert sched.schedule().finished_req_ids == {"r"}
    sched.assert_idle()


def test_max_model_len_caps_and_overlong_prompt_is_rejected() -> None:
    sched = make_scheduler(max_model_len=12)
    capped = make_request("capped", 10, max_tokens=100)
    too_long = make_request("long", 13)
    sched.add_request(capped)
    sched.add_request(too_long)
    assert too_long.status == RequestStatus.FINISHED_ERROR and sched.has_pending_outputs()
    streamed = run_until_idle(sched)
    assert streamed["capped"] == [SAMPLED, SAMPLED] and capped.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert streamed["long"] == [] and "13 tokens" in (too_long.error or "")
    sched.assert_idle()


# ---- preemption and KV pressure ---------------------------------------------------


def _pressure(policy: str) -> tuple:  # noqa: ANN401
    """3 blocks: h (16-token prompt, crosses a block boundary on its first decode) and
    two 10-token prompts of lower priority that arrived earlier."""
    sched = make_scheduler(num_blocks=3, policy=policy)
    early = make_request("early", 10, priority=1, arrival_time=1.0, max_tokens=4)
    late = make_request("late", 10, priority=1, arrival_time=2.0, max_tokens=4)
    high = make_request("high", 16, priority=0, arrival_time=3.0, max_tokens=4)
    for r in (early, late, high):
        sched.add_request(r)
    step(sched)
    return sched, early, late, high


def test_priority_preemption_picks_lowest_priority_latest_arrival() -> None:
    sched, early, late, high = _pressure("priority")
    assert [r.request_id for r in sched.running] == ["high", "early", "late"]
    out = sched.schedule()  # high needs a second block; none is free
    assert out.preempted_req_ids == {"late"} and "late" in out.finished_req_ids
    assert scheduled(out) == {"high": 1, "early": 1}
    assert late.status == RequestStatus.PREEMPTED and late.num_computed_tokens == 0
    assert late.num_preemptions == 1 and list(sched.waiting) == [late]
    assert sched.make_stats().num_preemptions == 1
    sched.update_from_output(out, fake_runner_output(sched, out))
    run_until_idle(sched)
    sched.assert_idle()


def test_fcfs_preemption_picks_last_running_even_the_asker() -> None:
    sched, early, late, high = _pressure("fcfs")
    assert [r.request_id for r in sched.running] == ["early", "late", "high"]
    out = sched.schedule()
    assert out.preempted_req_ids == {"high"} and scheduled(out) == {"early": 1, "late": 1}
    sched.update_from_output(out, fake_runner_output(sched, out))
    run_until_idle(sched)
    assert high.num_preemptions == 1 and high.status == RequestStatus.FINISHED_LENGTH_CAPPED
    sched.assert_idle()


def test_victim_scheduled_earlier_in_the_step_is_taken_back_and_uncached() -> None:
    sched = make_scheduler(num_blocks=4, long_prefill_token_threshold=20, policy="priority")
    low = make_request("low", 48, priority=1, arrival_time=1.0)
    sched.add_request(low)
    step(sched)  # low: tokens 0..19
    high = make_request("high", 16, priority=0, arrival_time=2.0, first_token=900)
    sched.add_request(high)
    out2, _ = step(sched)  # low: 20..39, high: its whole prompt; every block in use
    assert scheduled(out2) == {"low": 20, "high": 16} and sched.kv_cache_manager.num_free_blocks == 0
    # low is scheduled first (40..47 would complete block 2), then high needs a block: low is the victim.
    out3 = sched.schedule()
    assert out3.preempted_req_ids == {"low"} and scheduled(out3) == {"high": 1}
    assert out3.total_num_scheduled_tokens == 1 and out3.scheduled_cached_reqs.req_ids == ["high"]
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_cached_block(low.block_hashes[2]) is None  # never computed: not cached
    assert pool.get_cached_block(low.block_hashes[0]) is not None  # computed in step 1
    sched.update_from_output(out3, fake_runner_output(sched, out3))
    run_until_idle(sched)
    assert low.num_preemptions == 1 and len(low.output_token_ids) == 16
    sched.assert_idle()


def test_preempted_request_resumes_with_prompt_and_outputs() -> None:
    sched, early, late, high = _pressure("priority")
    step(sched)  # preempts late, which had sampled one token
    assert late.output_token_ids == [SAMPLED]
    resumed = None
    streamed: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        out, outs = step(sched)
        for o in outs:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
        for d in out.scheduled_new_reqs:
            if d.req_id == "late":
                resumed = d, out.num_scheduled_tokens["late"]
    assert resumed is not None
    data, n = resumed
    assert data.token_ids == late.prompt_token_ids + [SAMPLED]
    assert data.prompt_token_ids == late.prompt_token_ids
    assert data.num_computed_tokens + n == 11  # prompt + the generated token, recomputed
    assert len(late.output_token_ids) == 4 and len(streamed["late"]) == 3  # 1 before + 3 after
    sched.assert_idle()


def test_no_preemption_while_space_remains() -> None:
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=64)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 20 + 7 * i, max_tokens=12))
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert not out.preempted_req_ids and sched.make_stats().num_preemptions == 0
    sched.assert_idle()


def test_scheduling_under_heavy_pressure_always_completes() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=40, policy="priority")
    reqs = [make_request(f"r{i}", 15 + 5 * i, max_tokens=20, priority=i % 3) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    streamed = run_until_idle(sched)
    assert all(len(streamed[r.request_id]) == 20 == len(r.output_token_ids) for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    sched.assert_idle()


# ---- priority -------------------------------------------------------------------------


def test_priority_order_lower_value_first_ties_by_arrival() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    specs = [("p2", 2, 1.0), ("p0_late", 0, 5.0), ("p1", 1, 2.0), ("p0_early", 0, 4.0)]
    for rid, prio, arr in specs:
        sched.add_request(make_request(rid, 5, priority=prio, arrival_time=arr, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        order += [d.req_id for d in out.scheduled_new_reqs]
    assert order == ["p0_early", "p0_late", "p1", "p2"]
    sched.assert_idle()


def test_equal_priority_is_fcfs() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 5, arrival_time=10.0, max_tokens=1))
    out, _ = step(sched)
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    run_until_idle(sched)
    sched.assert_idle()


def test_max_num_seqs_caps_admission_and_queue_keeps_order() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    for rid, prio, arr in [("a", 1, 1.0), ("b", 0, 2.0), ("c", 2, 3.0), ("d", 0, 4.0)]:
        sched.add_request(make_request(rid, 5, priority=prio, arrival_time=arr, max_tokens=3))
    out, _ = step(sched)
    assert scheduled(out) == {"b": 5, "d": 5} and sched.num_running == 2
    assert [r.request_id for r in sched.waiting] == ["a", "c"]
    sched.add_request(make_request("e", 5, priority=1, arrival_time=0.5))
    assert [r.request_id for r in sched.waiting] == ["e", "a", "c"]
    run_until_idle(sched)
    sched.assert_idle()


# ---- prefix caching through the scheduler -----------------------------------------------


def test_identical_prompts_in_one_step_share_full_blocks() -> None:
    sched = make_scheduler()
    a, b = make_request("a", 40), make_request("b", 40)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert scheduled(out) == {"a": 40, "b": 8}
    new_a, new_b = out.scheduled_new_reqs
    assert new_b.num_computed_tokens == 32 and new_b.block_ids[:2] == new_a.block_ids[:2]
    assert new_b.block_ids[2] != new_a.block_ids[2]
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (80, 32)
    assert b.num_cached_tokens == 32 and a.num_cached_tokens == 0
    outs = sched.update_from_output(out, fake_runner_output(sched, out))
    assert [o.num_cached_tokens for o in outs] == [0, 32]
    run_until_idle(sched)
    sched.assert_idle()


def test_decode_allocates_a_block_only_at_a_boundary() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", 30, max_tokens=5))
    new_blocks = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        if out.scheduled_cached_reqs.req_ids:
            new_blocks.append(out.scheduled_cached_reqs.new_block_ids[0])
    # Inputs 31 and 32 fill block 1 (no allocation); input 33 opens block 2.
    assert [len(b) for b in new_blocks] == [0, 0, 1, 0]
    sched.assert_idle()


def test_prefix_stats_count_once_per_admission_again_after_preemption() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", 32, max_tokens=3)
    b = make_request("b", 31, max_tokens=3, first_token=1000)
    sched.add_request(a)
    sched.add_request(b)
    out1, _ = step(sched)
    assert (out1.prefix_cache_queries, out1.prefix_cache_hits) == (63, 0)
    out2, _ = step(sched)  # a crosses into a third block: b (last) is preempted
    assert out2.preempted_req_ids == {"b"} and out2.prefix_cache_queries == 0
    per_step = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        per_step.append((out.prefix_cache_queries, out.prefix_cache_hits))
    # b is queried again once, when it is re-admitted (32 tokens; its first block still cached).
    assert [q for q in per_step if q != (0, 0)] == [(32, 16)]
    assert (
        sched.kv_cache_manager.prefix_cache_queries == 95 and sched.kv_cache_manager.prefix_cache_hits == 16
    )
    assert b.num_cached_tokens == 0 and b.num_preemptions == 1
    sched.assert_idle()


# ---- abort --------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 20), make_request("wait", 20)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    sched.abort_requests(["wait", "run"])
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert running.output_token_ids == [SAMPLED] and sched.kv_cache_manager.num_used_blocks == 0
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and out.is_empty
    sched.assert_idle()


def test_abort_while_step_in_flight_keeps_blocks_until_the_step_returns() -> None:
    sched = make_scheduler()
    req, other = make_request("r", 20), make_request("o", 20, first_token=500)
    sched.add_request(req)
    sched.add_request(other)
    step(sched)
    in_flight = sched.schedule()
    sched.abort_requests(["r"])
    assert (
        sched.kv_cache_manager.get_block_ids("r") and sched.kv_cache_manager.num_used_blocks == 4
    )  # still used by the step
    outs = sched.update_from_output(in_flight, fake_runner_output(sched, in_flight, {"r": [9], "o": [9]}))
    assert [o.request_id for o in outs] == ["o"]
    assert req.status == RequestStatus.FINISHED_ABORTED and req.output_token_ids == [SAMPLED]
    assert sched.kv_cache_manager.num_used_blocks == 2
    out = sched.schedule()
    assert "r" in out.finished_req_ids and scheduled(out) == {"o": 1}
    sched.abort_requests(["o"])
    assert sched.update_from_output(out, fake_runner_output(sched, out)) == []
    sched.assert_idle()


def test_one_request_failure_finishes_only_that_request() -> None:
    sched = make_scheduler()
    bad, good = make_request("bad", 10), make_request("good", 10, first_token=500)
    sched.add_request(bad)
    sched.add_request(good)
    step(sched)
    (o,) = sched.finish_requests(["bad", "gone"], RequestStatus.FINISHED_ERROR, error="bad grammar")
    assert o.request_id == "bad" and o.finish_reason == FinishReason.ERROR and o.error == "bad grammar"
    assert o.new_token_ids == [] and bad.output_token_ids == [SAMPLED]
    out, _ = step(sched)
    assert out.finished_req_ids == {"bad"} and scheduled(out) == {"good": 1}
    run_until_idle(sched)
    assert good.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(good.output_token_ids) == 16
    sched.assert_idle()


# ---- outputs and stats ----------------------------------------------------------------------


def test_outputs_timestamps_and_stats_snapshot() -> None:
    ticks = iter(range(100, 10_000))
    sched = make_scheduler(num_blocks=8)
    sched.clock = lambda: float(next(ticks))
    sched.add_request(make_request("r", 20, max_tokens=2, arrival_time=50.0))
    out, outs = step(sched)
    stats = sched.make_stats()
    assert stats.as_dict() == {
        "num_running": 1, "num_waiting": 0, "kv_blocks_used": 2, "kv_blocks_total": 8, "kv_blocks_used_per_group": [],
        "num_prefill_tokens": 20, "num_decode_tokens": 0, "num_prefill_reqs": 1, "num_decode_reqs": 0,
        "prefix_cache_queries": 20, "prefix_cache_hits": 0, "num_preemptions": 0, "num_finished": 0, "num_kv_tokens_read": 0,
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [],
        **dict.fromkeys(KV_CONNECTOR_STATS, 0),  # no connector
    }  # fmt: skip
    (o,) = outs
    assert o.arrival_time == 50.0 and 100 <= o.first_scheduled_time < o.first_token_time
    assert not o.finished and o.finished_time == 0.0
    _, (last,) = step(sched)
    assert last.finished and last.finished_time >= last.first_token_time
    assert sched.make_stats().num_finished == 1 and sched.make_stats().num_decode_tokens == 1
    assert sched.make_stats().num_kv_tokens_read == 20  # the decode step reads the 20 prompt tokens
    sched.assert_idle()
