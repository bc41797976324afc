"""Priority scheduling displaces running requests of lower priority (issue 36, item 6).

With `policy=priority`, a waiting request that cannot be admitted for lack of a `max_num_seqs`
seat or of KV blocks preempts the lowest-priority running request, if that one's priority is
strictly lower (a larger value), as vLLM V1 does. Before, a high-priority arrival into a full
batch waited for a whole running request to finish. FCFS, and equal priorities, never displace.
Steps are counted with the fake runner (sched_utils), never timed.
"""

from __future__ import annotations

from sched_utils import fake_runner_output, make_request, make_scheduler, run_until_idle, step

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


def test_no_displacement_of_a_request_whose_blocks_an_admission_of_the_same_step_hit() -> None:
    """Found by the scheduler's state machine (test_scheduler_properties.py). A running request
    whose share of this step fills a block registers it in the prefix cache at allocation; an
    admission behind it in the same step hits that block (it reads the KV after the layer's
    write). Displacing the first request then for a third of higher priority left the block
    hashed and held with 9 of its 16 slots never written: the hit read garbage. Now the third
    waits one step; the block is written and hashed before anyone is displaced."""
    sched = make_scheduler(num_blocks=4, block_size=16, max_num_batched_tokens=10, max_num_seqs=2,
                           enable_chunked_prefill=False, policy="priority")  # fmt: skip
    prefix = list(range(1000, 1016))
    sched.add_request(make_request("low", prompt=prefix, max_tokens=1, priority=1))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"low": 10}  # its first 10 of 16 (the prompt passes the budget)
    sched.add_request(make_request("hit", prompt=[*prefix, 1200], max_tokens=1, priority=0))
    sched.add_request(make_request("high", prompt=[1250], max_tokens=1, priority=0))
    out = sched.schedule()
    # "low" fills its block (6 tokens), "hit" takes it as a 16-token hit and computes its last token.
    assert out.num_scheduled_tokens == {"low": 6, "hit": 1}
    assert out.preempted_req_ids == set(), "the block's writer was displaced in the step that fills it"
    block = sched.kv_cache_manager.req_to_blocks["low"][0]
    assert block.block_hash is not None and block is sched.kv_cache_manager.req_to_blocks["hit"][0]
    sched.update_from_output(out, fake_runner_output(sched, out))
    assert set(run_until_idle(sched)) >= {"high"}, "the third request is served after the write"
    sched.schedule()
    sched.assert_idle()
