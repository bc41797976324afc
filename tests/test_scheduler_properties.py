"""Property-based tests of the scheduler and the KV cache (issue 13): the cases nobody chose.

A hypothesis state machine drives one Scheduler with random arrivals (lengths, shared
prefixes, priorities, output lengths), steps whose fake model samples EOS at random,
aborts at any point (between steps and while a step is in flight), failed steps, and
a cache small enough that preemption happens. After every operation the block books
must balance; after draining, `assert_idle` (no request, every block free, ref counts 0)
and the free queue must be a consistent doubly linked list. Every block in the prefix cache
must hold KV that completed steps wrote (`WrittenKV`): a failed step writes nothing.

Profiles: `ci` (the default, well under a minute) and `soak` (`make soak`,
HYPOTHESIS_PROFILE=soak: thousands of examples, 10,000+ requests).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402
from sched_utils import EOS, SAMPLED, make_request, make_scheduler  # noqa: E402

from engine.core.sched.scheduler import Scheduler  # noqa: E402
from engine.request import Request, RequestStatus  # noqa: E402
from engine.step_io import ModelRunnerOutput, SchedulerOutput  # noqa: E402

settings.register_profile(
    "ci", max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "soak", max_examples=3000, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck)
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

# Shared prompt material: prefixes are cut from one corpus so that prompts share blocks.
CORPUS = list(range(1000, 1400))
COUNTS: Counter[str] = Counter()  # totals over the session, printed by the soak run


def check_books(sched: Scheduler) -> None:
    """Every block's ref count equals the requests holding it; the free queue holds exactly
    the blocks with ref count 0, once each, linked consistently both ways."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    for blocks in kv.req_to_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), "a request holds a block twice"
        holders.update(ids)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
    forward = pool.free_block_queue.get_all_free_blocks()
    backward = []
    node = pool.free_block_queue._tail.prev_free
    while node is not None and node is not pool.free_block_queue._head:
        backward.append(node)
        node = node.prev_free
    assert [b.block_id for b in forward] == [b.block_id for b in reversed(backward)]
    assert len({b.block_id for b in forward}) == len(forward) == pool.get_num_free_blocks()
    assert {b.block_id for b in forward} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for request in sched.running:
        held = len(kv.req_to_blocks.get(request.request_id, []))
        assert held * kv.block_size >= request.num_computed_tokens, request
        assert request.status == RequestStatus.RUNNING
    assert len(sched.running) <= sched.config.max_num_seqs


# What a KV slot holds, as the model would compute it: the hash of the block before it (or the
# chain's root and the request's salt) and the block's tokens up to and including the slot.
SlotContent = tuple[object, tuple[int, ...]]


class WrittenKV:
    """The KV every completed step wrote, slot by slot, to check that every block in the prefix
    cache holds what its hash says (issue 36: a failed step's blocks were left hashed)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, dict[int, SlotContent]] = {}  # block id -> offset -> content
        self.pending: dict[int, list[tuple[int, int, SlotContent]]] = {}  # per output not yet answered
        self.requests: list[Request] = []

    def scheduled(self, sched: Scheduler, out: SchedulerOutput) -> None:
        """Right after schedule(): the slots this step will write."""
        bs, kv = self.block_size, sched.kv_cache_manager
        writes: list[tuple[int, int, SlotContent]] = []
        self.pending[id(out)] = writes
        if not kv.enable_caching:
            return  # nothing is ever hashed (and requests carry no block hashes)
        for rid, n in out.num_scheduled_tokens.items():
            request = sched.requests[rid]
            blocks = kv.req_to_blocks[rid]
            for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
                i = pos // bs
                content = (self._parent(request, i), tuple(request.all_token_ids[i * bs : pos + 1]))
                writes.append((blocks[i].block_id, pos % bs, content))

    def completed(self, out: SchedulerOutput) -> None:
        for block_id, offset, content in self.pending.pop(id(out)):
            self.slots.setdefault(block_id, {})[offset] = content

    def failed(self, out: SchedulerOutput) -> None:
        del self.pending[id(out)]

    @staticmethod
    def _parent(request: Request, i: int) -> object:
        return request.block_hashes[i - 1] if i else ("root", request.cache_salt)

    @staticmethod
    def _block_hash(key: object) -> object:
        """The request's block hash of a key of the pool's cache (one group: the hash itself)."""
        return key

    def check(self, sched: Scheduler) -> None:
        """Every block holding a hash was written, every slot, by steps that completed."""
        parents = {h: self._parent(r, i) for r in self.requests for i, h in enumerate(r.block_hashes)}
        for key, block in sched.kv_cache_manager.block_pool.cached_block_hash_to_block.items():
            assert block.token_ids is not None
            parent = parents[self._block_hash(key)]
            want = {j: (parent, block.token_ids[: j + 1]) for j in range(self.block_size)}
            assert self.slots.get(block.block_id) == want, f"{block} is hashed but its KV was never written"


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.next_id = 0
        self.eos_rate = 0.0
        self.kv: WrittenKV | None = None

    @initialize(
        num_blocks=st.one_of(st.integers(4, 12), st.integers(13, 40)),
        block_size=st.sampled_from([4, 4, 16]),
        budget=st.integers(4, 160),
        max_num_seqs=st.sampled_from([1, 2, 4, 8, 8]),
        chunked=st.booleans(),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        long_prefill=st.sampled_from([0, 0, 8]),
        eos_rate=st.sampled_from([0.0, 0.1, 0.3]),
    )
    def setup(
        self, num_blocks: int, block_size: int, budget: int, max_num_seqs: int, chunked: bool,
        caching: bool, policy: str, long_prefill: int, eos_rate: float,
    ) -> None:
        self.sched = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
            long_prefill_token_threshold=long_prefill, policy=policy, enable_prefix_caching=caching,
        )
        self.eos_rate = eos_rate
        self.kv = WrittenKV(block_size)
        COUNTS["machines"] += 1

    # ---- operations -------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from([0, 8, 16, 32, 48]),
        tail=st.integers(0, 64),
        max_tokens=st.integers(1, 24),
        priority=st.integers(0, 3),
        offset=st.integers(0, 3),
    )
    def add(self, prefix: int, tail: int, max_tokens: int, priority: int, offset: int) -> None:
        assert self.sched is not None
        rid = f"r{self.next_id}"
        self.next_id += 1
        start = 200 + 50 * offset
        prompt = CORPUS[:prefix] + CORPUS[start : start + tail]
        if not prompt:
            prompt = [CORPUS[start]]
        request = make_request(rid, prompt=prompt, max_tokens=max_tokens, priority=priority)
        self.sched.add_request(request)
        assert self.kv is not None
        self.kv.requests.append(request)
        COUNTS["requests"] += 1

    @rule(data=st.data(), n=st.integers(1, 8))
    def steps(self, data: st.DataObject, n: int) -> None:
        for _ in range(n):
            out = self._schedule()
            self._answer(out, data)

    @precondition(lambda self: self.sched is not None and bool(self.sched.requests))
    @rule(data=st.data())
    def abort_while_in_flight(self, data: st.DataObject) -> None:
        assert self.sched is not None
        out = self._schedule()
        victim = data.draw(st.sampled_from(sorted(self.sched.requests) or ["none"]))
        self.sched.abort_requests([victim])
        COUNTS["aborts_in_flight"] += 1
        check_books(self.sched)
        self._answer(out, data)

    @precondition(lambda self: self.sched is not None and bool(self.sched.requests))
    @rule(data=st.data())
    def abort_between_steps(self, data: st.DataObject) -> None:
        assert self.sched is not None
        victim = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.abort_requests([victim])
        COUNTS["aborts"] += 1

    @precondition(lambda self: self.sched is not None and bool(self.sched.running))
    @rule()
    def failed_step(self) -> None:
        assert self.sched is not None
        out = self._schedule()
        self.sched.fail_step(out, "injected fault")
        assert self.kv is not None
        self.kv.failed(out)
        COUNTS["failed_steps"] += 1

    # ---- helpers ----------------------------------------------------------------------
    def _schedule(self):  # noqa: ANN202
        assert self.sched is not None
        out = self.sched.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= max(
            self.sched.config.max_num_batched_tokens, max(out.num_scheduled_tokens.values(), default=0)
        )
        COUNTS["steps"] += 1
        COUNTS["preemptions"] += self.sched.make_stats().num_preemptions
        assert self.kv is not None
        self.kv.scheduled(self.sched, out)
        return out

    def _answer(self, out, data: st.DataObject) -> None:  # noqa: ANN001
        """Play the model: requests brought level with their tokens sample one token."""
        assert self.sched is not None
        req_ids, sampled = [], []
        for rid in out.num_scheduled_tokens:
            request = self.sched.requests.get(rid)
            done = request is not None and request.num_computed_tokens >= request.num_tokens
            eos = self.eos_rate > 0 and data.draw(st.floats(0, 1)) < self.eos_rate
            req_ids.append(rid)
            sampled.append([EOS if eos else SAMPLED] if done else [])
        assert self.kv is not None
        self.kv.completed(out)  # the runner wrote the step's KV before sampling
        self.sched.update_from_output(out, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))

    @invariant()
    def books_balance(self) -> None:
        if self.sched is not None:
            check_books(self.sched)

    @invariant()
    def every_hashed_block_was_written(self) -> None:
        if self.sched is not None and self.kv is not None:
            self.kv.check(self.sched)

    def teardown(self) -> None:
        sched = self.sched
        if sched is None:
            return
        for _ in range(5000):
            if not sched.has_unfinished_requests():
                break
            out = self._schedule()
            assert self.kv is not None
            self.kv.completed(out)
            req_ids = list(out.num_scheduled_tokens)
            sampled = [
                [SAMPLED] if (r := sched.requests.get(rid)) and r.num_computed_tokens >= r.num_tokens else []
                for rid in req_ids
            ]
            sched.update_from_output(out, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))
            check_books(sched)
        else:
            raise AssertionError("the scheduler did not drain in 5000 steps (livelock?)")
        sched.schedule()  # hands the last finished ids over
        sched.assert_idle()


SchedulerMachine.TestCase.settings = settings.get_profile(PROFILE)
TestSchedulerProperties = SchedulerMachine.TestCase


def test_zz_soak_totals(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints what the machine exercised (quoted from `make soak`); fails if it exercised nothing."""
    if COUNTS["machines"] == 0:
        pytest.skip("the state machine did not run in this session (deselected)")
    with capsys.disabled():
        print("\nscheduler properties:", dict(sorted(COUNTS.items())))
    assert COUNTS["requests"] > 0 and COUNTS["steps"] > 0
