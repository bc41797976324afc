"""External KV loads under KV pressure, through the scheduler with a fake store (issue 36, item 5).

A finished load used to give its blocks back and re-admit its request through an ordinary prefix
hit; a running request allocating in between evicted the loaded blocks, and the admission asked
the store again: the same blocks were fetched twice (or more). Now a loaded request keeps its
blocks and is admitted on them (`RemoteKVWaits.ready`), as vLLM's does.
"""

from __future__ import annotations

from collections import Counter

import pytest
from sched_utils import fake_runner_output, make_request

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.kv_cache.hashing import hash_request_blocks
from engine.core.sched.scheduler import Scheduler
from engine.kv_transfer.base import KVConnectorBase, KVConnectorRole
from engine.kv_transfer.metadata import KVConnectorOutput
from engine.request import Request, RequestStatus

BS = 16


class FakeStore(KVConnectorBase):
    """The scheduler half of a store that holds every block of `prompts`; a load takes
    `load_steps` steps to report. Counts the blocks each request loads."""

    def __init__(self, prompts: list[list[int]], load_steps: int) -> None:
        config = EngineConfig()
        config.cache.block_size = BS
        super().__init__(config, KVConnectorRole.SCHEDULER)
        self.stored = {h for p in prompts for h in hash_request_blocks(p, BS)}
        self.load_steps = load_steps
        self.in_flight: dict[str, int] = {}  # request id -> steps left
        self.blocks_loaded: Counter[str] = Counter()
        self.loads: Counter[str] = Counter()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        start, n = num_computed_tokens // BS, 0
        for h in request.block_hashes[start : (request.num_tokens - 1) // BS]:
            if h not in self.stored:
                break
            n += 1
        return n * BS, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local: int, num_external: int) -> None:
        self.loads[request.request_id] += 1
        self.blocks_loaded[request.request_id] += num_external // BS
        self.in_flight[request.request_id] = self.load_steps

    def report(self) -> KVConnectorOutput:
        """The worker's report after one step: loads whose time is up."""
        done = set()
        for rid in list(self.in_flight):
            self.in_flight[rid] -= 1
            if self.in_flight[rid] <= 0:
                done.add(rid)
                del self.in_flight[rid]
        return KVConnectorOutput(finished_recving=done)


def _scheduler(store: FakeStore, num_blocks: int, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        num_blocks=num_blocks,
        max_model_len=4096,
        kv_connector=store,
    )


def _drain(sched: Scheduler, store: FakeStore, max_steps: int = 300) -> set[str]:
    finished: set[str] = set()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        out = sched.schedule()
        runner = fake_runner_output(sched, out)
        runner.kv_connector_output = store.report()
        finished |= {o.request_id for o in sched.update_from_output(out, runner) if o.finish_reason is not None}
    raise AssertionError(f"not idle after {max_steps} steps: {sorted(sched.requests)}")


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + seed * 500 + i for i in range(n)]


@pytest.mark.parametrize("load_steps", [1, 2, 3])
def test_each_load_happens_once_in_a_cache_too_small_for_two(load_steps: int) -> None:
    """9 blocks, two prompts of 5 stored blocks and a tail (their loads never fit at once), two
    seats. `a` starts its load and `c` takes the second seat, so `a`'s finished load waits for a
    seat while `d` and `c` decode across block boundaries. Every request completes and each
    prompt's 5 blocks are fetched exactly once (before: `a`'s were fetched again, 7 blocks)."""
    a, b = _prompt(1, 5 * BS + 9), _prompt(2, 5 * BS + 9)
    store = FakeStore([a, b], load_steps)
    sched = _scheduler(store, num_blocks=9, max_num_seqs=2)
    sched.add_request(make_request("d", prompt=_prompt(3, 20), max_tokens=24))
    sched.add_request(make_request("a", prompt=a, max_tokens=6))
    sched.add_request(make_request("c", prompt=_prompt(4, 20), max_tokens=16))
    sched.add_request(make_request("b", prompt=b, max_tokens=6))
    assert _drain(sched, store) == {"d", "a", "c", "b"}
    assert (store.loads, store.blocks_loaded) == (Counter(a=1, b=1), Counter(a=5, b=5))
    sched.schedule()
    sched.assert_idle()


def test_a_loaded_request_is_admitted_on_the_blocks_it_loaded_into() -> None:
    a = _prompt(1, 4 * BS + 9)
    store = FakeStore([a], load_steps=1)
    sched = _scheduler(store, num_blocks=16)
    sched.add_request(make_request("a", prompt=a, max_tokens=2))
    out = sched.schedule()  # starts the load
    assert sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loaded_into = sched.kv_cache_manager.get_block_ids("a")
    runner = fake_runner_output(sched, out)
    runner.kv_connector_output = store.report()
    sched.update_from_output(out, runner)
    assert sched.kv_cache_manager.get_block_ids("a") == loaded_into, "the loaded blocks were given back"
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.num_scheduled_tokens["a"]) == (4 * BS, 9)
    assert new.block_ids[:4] == loaded_into
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (4 * BS + 9, 4 * BS)
    sched.update_from_output(out, fake_runner_output(sched, out))
    assert _drain(sched, store) == {"a"}
    sched.schedule()
    sched.assert_idle()


def test_ready_holders_give_their_blocks_back_when_nothing_else_could_make_room() -> None:
    """Two loads of 3 blocks finish at once in 7 blocks; `a` needs 2 more, 1 is free and nothing
    runs: `b` gives its blocks back (they stay cached) rather than deadlock."""
    a, b = _prompt(1, 3 * BS + 25), _prompt(2, 3 * BS + 9)
    store = FakeStore([a, b], load_steps=1)
    sched = _scheduler(store, num_blocks=7)
    sched.add_request(make_request("a", prompt=a, max_tokens=4))
    sched.add_request(make_request("b", prompt=b, max_tokens=4))
    sched.schedule()  # both loads start
    assert store.loads == Counter(a=1, b=1)
    assert _drain(sched, store) == {"a", "b"}
    sched.schedule()
    sched.assert_idle()
