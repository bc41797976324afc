"""Priority scheduling displaces running requests of lower priority (issue 36, item 6).

With `policy=priority`, a waiting request that cannot be admitted for lack of a `max_num_seqs`
seat or of KV blocks preempts the lowest-priority running request, if that one's priority is
strictly lower (a larger value), as vLLM V1 does. Before, a high-priority arrival into a full
batch waited for a whole running request to finish. FCFS, and equal priorities, never displace.
Steps are counted with the fake runner (sched_utils), never timed.
"""

from __future__ import annotations

from sched_utils import make_request, make_scheduler, run_until_idle, step

from engine.core.sched.scheduler import Scheduler


def _fill(sched: Scheduler, n: int, prompt_len: int, priority: int, max_tokens: int = 40, steps: int = 3) -> None:
    """`n` running requests of `priority`, `steps` steps into their run (admitted, prefilled, decoding)."""
    for i in range(n):
        sched.add_request(make_request(f"low{i}", prompt_len, max_tokens=max_tokens, priority=priority,
                                       first_token=100 + 1000 * i))  # fmt: skip
    for _ in range(steps):
        step(sched)
    assert sched.num_running == n and sched.num_waiting == 0


def _steps_to_first_token(sched: Scheduler, rid: str, limit: int = 200) -> tuple[int, set[str]]:
    """Steps until `rid` gets its first token, and the requests preempted meanwhile."""
    preempted: set[str] = set()
    for n in range(1, limit + 1):
        out, outputs = step(sched)
        preempted |= out.preempted_req_ids
        if any(o.request_id == rid and o.new_token_ids for o in outputs):
            return n, preempted
    raise AssertionError(f"{rid} got no token in {limit} steps")


def test_a_high_priority_arrival_into_a_full_batch_gets_a_seat_in_one_step() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    _fill(sched, 2, prompt_len=20, priority=1)
    sched.add_request(make_request("high", 12, priority=0, max_tokens=4, first_token=5000))
    ttft_steps, preempted = _steps_to_first_token(sched, "high")
    assert (ttft_steps, preempted) == (1, {"low1"}), "the latest low-priority request gives its seat"
    assert sched.requests["low1"].status.name == "PREEMPTED"
    assert set(run_until_idle(sched)) == {"high", "low0", "low1"}, "every request completes"
    sched.schedule()
    sched.assert_idle()


def test_a_high_priority_arrival_short_of_kv_blocks_displaces_in_one_step() -> None:
    """Seats to spare, but the low-priority requests hold every block (8 of 4 tokens each)."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8, policy="priority")
    _fill(sched, 2, prompt_len=14, priority=3, steps=1)  # prefilled: 4 blocks each, every block held
    assert sched.kv_cache_manager.num_free_blocks == 0
    sched.add_request(make_request("high", 6, priority=0, max_tokens=2, first_token=5000))
    ttft_steps, preempted = _steps_to_first_token(sched, "high")
    assert ttft_steps == 1 and preempted, "no running request was displaced"
    run_until_idle(sched)
    sched.schedule()
    sched.assert_idle()


def test_fcfs_and_equal_priorities_never_displace() -> None:
    """The same full batch: under FCFS, or at equal priority, the arrival waits for a seat (a
    running request's whole remaining output), and nothing is preempted."""
    for policy, priority in (("fcfs", 0), ("priority", 0)):
        sched = make_scheduler(max_num_seqs=2, policy=policy)
        _fill(sched, 2, prompt_len=20, priority=priority)
        sched.add_request(make_request("new", 12, priority=priority, max_tokens=4, first_token=5000))
        ttft_steps, preempted = _steps_to_first_token(sched, "new")
        assert preempted == set(), policy
        assert ttft_steps > 30, (policy, ttft_steps)
        run_until_idle(sched)
