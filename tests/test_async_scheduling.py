"""Async scheduling in the scheduler: output placeholders and a batch queue of depth 2.

Driven with hand-made runner outputs like test_scheduler.py, but the next step is
scheduled before the previous one is answered, as `EngineCore.step_with_batch_queue`
does. Every test ends with `assert_idle()`.
"""

from __future__ import annotations

from collections import deque

from sched_utils import EOS, SAMPLED, fake_runner_output, make_request

from engine.config import CacheConfig, SchedulerConfig
from engine.core.sched.scheduler import Scheduler
from engine.request import RequestStatus
from engine.seam import EngineCoreOutput, FinishReason
from engine.step_io import ModelRunnerOutput, SchedulerOutput


def make_async_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 2048, **kw: object) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, async_scheduling=True, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg, CacheConfig(block_size=16), num_blocks=num_blocks, max_model_len=4096)


class AsyncDriver:
    """Plays EngineCore.step_with_batch_queue over a scheduler with a fake runner.

    The fake runner decides at schedule time which requests sample (the real one
    decides at prepare time, from the same counts); `tokens(step, req_id)` picks the id.
    """

    def __init__(self, sched: Scheduler, tokens=None) -> None:  # noqa: ANN001
        self.sched = sched
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens = tokens or (lambda step, rid: SAMPLED)
        self.num_scheduled = 0
        self.streamed: dict[str, list[int]] = {}
        self.finished: dict[str, EngineCoreOutput] = {}

    def schedule(self) -> SchedulerOutput:
        so = self.sched.schedule()
        if so.total_num_scheduled_tokens:
            step = self.num_scheduled
            sample = {rid: [self.tokens(step, rid)] for rid in so.num_scheduled_tokens}
            self.queue.append((so, fake_runner_output(self.sched, so, sample)))
            self.num_scheduled += 1
        return so

    def answer_oldest(self) -> list[EngineCoreOutput]:
        so, out = self.queue.popleft()
        return self._record(self.sched.update_from_output(so, out))

    def step(self) -> list[EngineCoreOutput]:
        so = None
        if len(self.queue) < 2 and self.sched.has_unfinished_requests():
            so = self.schedule()
            if so.total_num_scheduled_tokens and len(self.queue) < 2:
                return []
        if not self.queue:
            return self._record(self.sched.update_from_output(so or SchedulerOutput.empty(), _no_tokens()))
        return self.answer_oldest()

    def run_until_idle(self, max_calls: int = 1000) -> dict[str, list[int]]:
        for _ in range(max_calls):
            if not self.sched.has_unfinished_requests() and not self.queue:
                return self.streamed
            self.step()
        raise AssertionError(f"not idle after {max_calls} calls")

    def _record(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for o in outputs:
            self.streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in self.finished, f"{o.request_id} finished twice"
                self.finished[o.request_id] = o
        return outputs


def _no_tokens() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


def test_next_decode_is_scheduled_on_a_placeholder() -> None:
    sched = make_async_scheduler()
    r = make_request("r", 20, max_tokens=4)
    sched.add_request(r)
    d = AsyncDriver(sched)
    so1 = d.schedule()
    assert so1.num_scheduled_tokens == {"r": 20}
    assert r.num_output_placeholders == 1 and r.num_computed_tokens == 20 and r.num_tokens == 20
    so2 = d.schedule()  # step 1 still in flight: its token is a placeholder
    assert so2.num_scheduled_tokens == {"r": 1}
    assert so2.num_decode_tokens == 1 and so2.num_prefill_tokens == 0
    assert so2.scheduled_cached_reqs.num_computed_tokens == [20]
    assert r.num_output_placeholders == 2 and r.num_computed_tokens == 21
    outs = d.answer_oldest()
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("r", [SAMPLED])]
    assert r.num_output_placeholders == 1 and r.num_tokens == 21
    d.run_until_idle()
    assert d.streamed == {"r": [SAMPLED] * 4}
    assert d.finished["r"].finish_reason == FinishReason.LENGTH
    sched.assert_idle()


def test_partial_prefill_has_no_placeholder() -> None:
    sched = make_async_scheduler(max_num_batched_tokens=16)
    r = make_request("r", 40, max_tokens=2)
    sched.add_request(r)
    d = AsyncDriver(sched)
    assert d.schedule().num_scheduled_tokens == {"r": 16}
    assert r.num_output_placeholders == 0
    assert d.schedule().num_scheduled_tokens == {"r": 16}
    assert r.num_output_placeholders == 0
    d.answer_oldest()
    assert d.schedule().num_scheduled_tokens == {"r": 8}  # the last chunk samples
    assert r.num_output_placeholders == 1
    d.run_until_idle()
    assert d.streamed == {"r": [SAMPLED] * 2}
    sched.assert_idle()


def test_max_tokens_reached_in_flight_schedules_no_extra_step() -> None:
    sched = make_async_scheduler()
    r = make_request("r", 10, max_tokens=3)
    sched.add_request(r)
    d = AsyncDriver(sched)
    d.schedule()  # prefill: samples token 1
    d.schedule()  # samples token 2
    d.answer_oldest()
    d.schedule()  # samples token 3 (the last)
    assert r.num_output_tokens + r.num_output_placeholders == 3
    so = d.schedule()  # queue has room, but every token r may get is in flight
    assert "r" not in so.num_scheduled_tokens and so.total_num_scheduled_tokens == 0
    d.run_until_idle()
    assert d.streamed == {"r": [SAMPLED] * 3}
    assert d.num_scheduled == 3
    sched.assert_idle()


def test_stop_token_with_a_step_in_flight_discards_its_token() -> None:
    # r samples EOS at its second step; the third was scheduled before that was known.
    sched = make_async_scheduler()
    r = make_request("r", 10, max_tokens=10)
    other = make_request("o", 10, max_tokens=5, first_token=500)
    sched.add_request(r)
    sched.add_request(other)
    d = AsyncDriver(sched, tokens=lambda step, rid: EOS if (rid == "r" and step == 1) else SAMPLED)
    d.schedule()
    so2 = d.schedule()
    d.answer_oldest()
    so3 = d.schedule()
    assert "r" in so2.num_scheduled_tokens and "r" in so3.num_scheduled_tokens
    used_before = sched.kv_cache_manager.num_used_blocks
    outs = d.answer_oldest()  # step 2: r stops at EOS while step 3 computes its next token
    r_out = [o for o in outs if o.request_id == "r"]
    assert r_out[0].new_token_ids == [EOS] and r_out[0].finish_reason == FinishReason.STOP
    assert r.status == RequestStatus.FINISHED_STOPPED
    # Step 3 still reads r's blocks: they stay allocated until it is answered.
    assert sched.kv_cache_manager.num_used_blocks == used_before
    so4 = d.schedule()
    assert "r" in so4.finished_req_ids and "r" not in so4.num_scheduled_tokens
    outs = d.answer_oldest()  # step 3: r's extra token is discarded
    assert all(o.request_id != "r" for o in outs)
    assert sched.kv_cache_manager.num_used_blocks == 1  # only o's block: r's freed
    d.run_until_idle()
    assert d.streamed["r"] == [SAMPLED, EOS]
    assert d.streamed["o"] == [SAMPLED] * 5
    sched.assert_idle()


def test_abort_while_two_steps_are_in_flight() -> None:
    sched = make_async_scheduler()
    sched.add_request(make_request("a", 20, max_tokens=8))
    sched.add_request(make_request("b", 20, max_tokens=8, first_token=300))
    d = AsyncDriver(sched)
    d.schedule()
    d.schedule()
    assert sched.kv_cache_manager.num_used_blocks == 4
    sched.abort_requests(["a"])
    # Both steps read a's blocks: none is freed before the second is answered.
    assert sched.kv_cache_manager.num_used_blocks == 4
    outs = d.answer_oldest()
    assert [o.request_id for o in outs] == ["b"]  # a's token is dropped
    assert sched.kv_cache_manager.num_used_blocks == 4
    so = d.schedule()
    assert so.finished_req_ids == {"a"} and set(so.num_scheduled_tokens) == {"b"}
    d.answer_oldest()
    assert sched.kv_cache_manager.num_used_blocks == 2  # a's blocks back once step 2 is answered
    d.run_until_idle()
    assert "a" not in d.streamed or d.streamed["a"] == []
    assert d.streamed["b"] == [SAMPLED] * 8
    sched.assert_idle()


def test_abort_of_a_waiting_request_frees_at_once() -> None:
    sched = make_async_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 20, max_tokens=4))
    sched.add_request(make_request("w", 20, max_tokens=4, first_token=300))
    d = AsyncDriver(sched)
    d.schedule()
    sched.abort_requests(["w"])  # never scheduled: nothing reads its (absent) blocks
    assert sched.num_waiting == 0
    d.run_until_idle()
    assert d.streamed == {"a": [SAMPLED] * 4}
    sched.assert_idle()


def test_preemption_while_a_step_is_in_flight() -> None:
    # 4 blocks of 16: a and b hold 2 each after crossing 16 tokens... a needs a third.
    sched = make_async_scheduler(num_blocks=4)
    a = make_request("a", 30, max_tokens=12)
    b = make_request("b", 30, max_tokens=12, first_token=300)
    sched.add_request(a)
    sched.add_request(b)
    d = AsyncDriver(sched)
    d.run_until_idle()
    assert a.num_preemptions + b.num_preemptions >= 1
    assert d.streamed == {"a": [SAMPLED] * 12, "b": [SAMPLED] * 12}
    assert d.finished["a"].finish_reason == FinishReason.LENGTH
    sched.assert_idle()


def test_preempted_request_drops_its_in_flight_token_and_recomputes() -> None:
    sched = make_async_scheduler(num_blocks=4)
    a = make_request("a", 31, max_tokens=4)
    b = make_request("b", 31, max_tokens=4, first_token=300)
    sched.add_request(a)
    sched.add_request(b)
    d = AsyncDriver(sched)
    d.schedule()  # both prefill 31 tokens: 2 blocks each, all 4 used
    so2 = d.schedule()  # a's decode at position 31 fits its 2nd block; so does b's
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1}
    d.answer_oldest()
    so3 = d.schedule()  # a needs a 3rd block: b (the latest) is preempted while step 2 runs
    assert so3.preempted_req_ids == {"b"} and so3.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    assert b.num_output_tokens == 1  # its token from step 1; step 2's is still in flight
    outs = d.answer_oldest()  # step 2: b's token is discarded (b no longer runs)
    assert [o.request_id for o in outs] == ["a"]
    assert b.num_output_tokens == 1
    d.run_until_idle()
    assert d.streamed == {"a": [SAMPLED] * 4, "b": [SAMPLED] * 4}
    sched.assert_idle()


def test_sync_scheduler_never_uses_placeholders() -> None:
    cfg = SchedulerConfig()
    sched = Scheduler(cfg, CacheConfig(block_size=16), num_blocks=64, max_model_len=4096)
    r = make_request("r", 20, max_tokens=2)
    sched.add_request(r)
    out = sched.schedule()
    assert r.num_output_placeholders == 0
    sched.update_from_output(out, fake_runner_output(sched, out))
    out = sched.schedule()
    sched.update_from_output(out, fake_runner_output(sched, out))
    assert not sched.has_unfinished_requests()
    sched.assert_idle()


def test_rejected_request_is_reported_with_nothing_in_flight() -> None:
    sched = make_async_scheduler()
    sched.add_request(make_request("huge", 5000))
    d = AsyncDriver(sched)
    outs = d.step()
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR]
    sched.assert_idle()
