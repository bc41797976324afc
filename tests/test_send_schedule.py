"""The send rules shared by the driver and the simulator, and the one record builder."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from analysis.record import RequestRecord, TargetResult
from workloads.driver import run_workload
from workloads.record_builder import build_record, record_from_result
from workloads.send_schedule import Send, SendSchedule
from workloads.spec import RequestSpec
from workloads.targets.scripted import Script, ScriptedTarget


def _spec(rid: str, arrival: float = 0.0, **kw) -> RequestSpec:  # type: ignore[no-untyped-def]
    return RequestSpec(rid, arrival, None, [1, 2, 3], 3, 2, **kw)


def _next_turn(spec: RequestSpec, record: RequestRecord) -> RequestSpec | None:
    if spec.turn >= 1 or not record.ok:
        return None
    return replace(spec, request_id=f"{spec.session_id}-t1", arrival_s=record.done_s + 0.05, turn=1)


def _done(spec: RequestSpec, at: float = 1.0) -> RequestRecord:
    return build_record(spec, scheduled_s=0.0, start_s=0.0, token_times=[at], done_s=at)


def test_open_loop_sends_every_spec_at_its_arrival() -> None:
    specs = [_spec("a", 0.0), _spec("b", 0.5)]
    schedule = SendSchedule()
    assert schedule.first(specs) == [Send(specs[0], 0.0), Send(specs[1], 0.5)]
    assert schedule.slots == 0 and schedule.after(Send(specs[0], 0.0), _done(specs[0])) is None
    assert SendSchedule(concurrency=4).slots == 4  # open loop: a due send takes a slot first


def test_closed_loop_users_take_the_queue_in_order() -> None:
    specs = [_spec(r) for r in "abcd"]
    schedule = SendSchedule(closed_loop=True, concurrency=3)
    first = schedule.first(specs)
    assert [(s.spec.request_id, s.at_s, s.user) for s in first] == [("a", None, 0), ("b", None, 1), ("c", None, 2)]
    assert schedule.slots == 0  # the users are the limit, no slot to wait for
    nxt = schedule.after(first[1], _done(specs[1]))
    assert nxt == Send(specs[3], None, 1)  # user 1 takes d, at once
    assert schedule.after(first[0], _done(specs[0])) is None  # the queue is empty
    # Fewer specs than users: only as many users start.
    assert len(SendSchedule(closed_loop=True, concurrency=5).first(specs[:2])) == 2
    with pytest.raises(ValueError, match="closed loop needs concurrency >= 1"):
        SendSchedule(closed_loop=True)


def test_a_follow_up_comes_first_at_its_own_time_by_the_same_user() -> None:
    turn0 = _spec("s-t0", session_id="s", follow_up=_next_turn)
    other = _spec("x")
    schedule = SendSchedule(closed_loop=True, concurrency=1)
    (send,) = schedule.first([turn0, other])
    nxt = schedule.after(send, _done(turn0, at=2.0))
    assert nxt is not None and nxt.is_follow_up and nxt.user == 0
    assert nxt.spec.request_id == "s-t1" and nxt.at_s == pytest.approx(2.05)
    assert schedule.after(nxt, _done(nxt.spec, at=3.0)) == Send(other, None, 0)  # session over: next spec
    open_loop = SendSchedule()
    (s0,) = open_loop.first([turn0])
    assert open_loop.after(s0, _done(turn0, at=2.0)).spec.turn == 1  # type: ignore[union-attr]


def test_build_record_rules() -> None:
    spec = _spec("r", group="g", is_warmup=True, session_id="s", turn=2)
    rec = build_record(spec, scheduled_s=0.1, start_s=0.2, token_times=[0.3, 0.4], done_s=0.5)
    assert (rec.request_id, rec.group, rec.is_warmup, rec.session_id, rec.turn) == ("r", "g", True, "s", 2)
    assert rec.prompt_tokens == 3 and rec.output_tokens == 2 and rec.ok and rec.error == ""
    # Counts given win; a request with no token and no error failed for that reason.
    assert build_record(spec, scheduled_s=0, start_s=0, token_times=[0.1], done_s=0.1, prompt_tokens=7,
                        output_tokens=4).prompt_tokens == 7  # fmt: skip
    empty = build_record(spec, scheduled_s=0.0, start_s=0.0, token_times=[], done_s=0.0)
    assert empty.error == "no content chunk received" and not empty.ok
    # A target result: perf_counter times rebased to the run start; `now_s` when it gives no done time.
    res = TargetResult(chunk_times=[10.5, 10.7], chunk_tokens=[1, 2], output_tokens=None, finish_reason="length")
    rec = record_from_result(spec, res, t0=10.0, scheduled_s=0.4, start_s=0.45, lateness_s=0.05, now_s=0.9)
    assert rec.token_times == pytest.approx([0.5, 0.6, 0.7]) and rec.done_s == 0.9 and rec.output_tokens == 3
    assert rec.lateness_s == 0.05 and rec.session_id == "s"


def test_driver_closed_loop_user_finishes_its_session_first() -> None:
    """The same rule through the asyncio driver (as the simulator's test checks on virtual time)."""
    turn0 = _spec("s-t0", session_id="s", follow_up=_next_turn)
    tgt = ScriptedTarget(Script(ttft_s=0.01, output_tokens=1))
    result = asyncio.run(run_workload([turn0, _spec("x")], tgt, closed_loop=True, concurrency=1))
    assert tgt.sent == ["s-t0", "s-t1", "x"]
    t0, t1, x = sorted(result.records, key=lambda r: r.start_s)
    assert t1.scheduled_s == pytest.approx(t0.done_s + 0.05) and t1.turn == 1
    assert x.start_s >= t1.done_s


def _run_cfg(*overrides: str):  # type: ignore[no-untyped-def]
    from conf.schema import RunConfig, compose_typed

    return compose_typed(RunConfig, "run", list(overrides))


def test_send_limits_from_the_config() -> None:
    from workloads.send_schedule import send_limits

    assert send_limits(_run_cfg()) == (False, None)
    assert send_limits(_run_cfg("workload.arrival.max_concurrency=16")) == (False, 16)
    assert send_limits(_run_cfg("workload.arrival.process=closed", "workload.arrival.concurrency=3")) == (True, 3)
    assert send_limits(_run_cfg("workload.concurrency=5")) == (True, 5)  # the short form
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        send_limits(_run_cfg("workload.arrival.max_concurrency=0"))


def test_hydra_flags_go_before_the_overrides() -> None:
    from workloads.cli import flags_first

    assert flags_first(["target=openai", "--cfg", "job", "x=1"]) == ["--cfg", "job", "target=openai", "x=1"]
    assert flags_first(["-m", "a=1,2", "b=3"]) == ["-m", "a=1,2", "b=3"]
