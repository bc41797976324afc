"""KV cache groups (issue 58 item 3; engine/kv_cache_spec.py, engine/core/kv_cache/group_blocks.py).

Layers grouped by attention type over one block pool; a sliding-window group gives back the blocks
wholly outside the window. Checked here: the grouping rule, the blocks a long request holds per
group (from the scheduler's own stats, and from the real Gemma 3 270M engine's StepStats), prefix
hits once the old window blocks are evicted, and a hypothesis state machine of the scheduler with
two groups (books balance in every group, every block a step reads or writes is held, every hashed
block was written, the scheduler drains to idle).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from sched_utils import fake_runner_output, make_request, step

from engine.config import CacheConfig, SchedulerConfig
from engine.core.sched.scheduler import Scheduler
from engine.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, layer_placement, tokens_alone
from engine.request import Request
from engine.step_io import SchedulerOutput

GEMMA_270M_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def make_grouped(groups: tuple[KVCacheGroupSpec, ...], num_blocks: int, block_size: int = 16, budget: int = 512,
                 max_num_seqs: int = 8, caching: bool = True, max_model_len: int = 8192) -> Scheduler:  # fmt: skip
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks=num_blocks,
                     max_model_len=max_model_len, kv_cache_groups=groups)  # fmt: skip


def test_gemma_3_layers_form_one_full_group_and_five_sliding_ones() -> None:
    groups = kv_cache_groups(GEMMA_270M_WINDOWS)
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.kind for g in groups] == ["full"] + ["sliding"] * 5 and groups[1].sliding_window == 512
    placement = layer_placement(groups, 18)
    assert placement[5] == (0, 0) and placement[6] == (2, 2) and placement[17] == (0, 2)
    # every layer alike: one group of every layer, one tensor per layer (the cache of before)
    assert kv_cache_groups([None] * 30) == (KVCacheGroupSpec(tuple(range(30))),)
    assert [p[1] for p in layer_placement(kv_cache_groups([None] * 4), 4)] == [0, 1, 2, 3]
    # gemma-3-27b: 10 global layers of 62, the local ones in groups of 10 (the last one short)
    big = kv_cache_groups([None if (i + 1) % 6 == 0 else 1024 for i in range(62)])
    assert [len(g.layers) for g in big] == [10, 10, 10, 10, 10, 10, 2]
    with pytest.raises(ValueError, match="no layers"):
        kv_cache_groups([])


def test_one_full_group_holds_what_one_block_list_held() -> None:
    assert tokens_alone((KVCacheGroupSpec((0, 1)),), 10, 16, 2048) == 160
    groups = kv_cache_groups(GEMMA_270M_WINDOWS)
    # 4,096 tokens in chunks of 512: 256 full blocks, 5 x (511 + 512) / 16 + 1 sliding ones
    assert tokens_alone(groups, 256 + 5 * 65, 16, 512) == 4096


def _run_prefill(sched: Scheduler, request: Request) -> list[list[int]]:
    """Step until the request has sampled its first token; the blocks it held per group after each step."""
    sched.add_request(request)
    held = []
    while request.num_output_tokens == 0:
        step(sched)
        held.append(sched.kv_cache_manager.blocks_held(request.request_id))
    return held


def test_a_4k_gemma_request_holds_a_window_per_sliding_group() -> None:
    """The scheduler's own books (StepStats' kv_blocks_used_per_group) for one 4,096-token prompt."""
    groups = kv_cache_groups(GEMMA_270M_WINDOWS)
    sched = make_grouped(groups, num_blocks=1000)
    request = make_request("long", 4096, max_tokens=8)
    held = _run_prefill(sched, request)
    assert held[0] == [32] * 6  # the first 512-token chunk
    assert held[-1] == [256] + [64] * 5, held[-1]  # the last chunk and the window before it
    assert max(h[1] for h in held) <= 65  # a chunk plus the window before it, at most
    step(sched)  # the first decode step gives back what its query's window no longer reads
    stats = sched.make_stats()
    assert stats.kv_blocks_used_per_group == [257] + [33] * 5 and stats.kv_blocks_used == 257 + 5 * 33
    for _ in range(5):
        step(sched)
    assert sched.kv_cache_manager.blocks_held("long") == [257] + [33] * 5  # 512 / 16 + 1, not 257
    while sched.has_unfinished_requests():
        step(sched)
    sched.schedule()
    sched.assert_idle()
    # before groups: one list of every position for every layer, 257 blocks of 18 layers each
    one_group = make_grouped((), num_blocks=1000)
    assert _run_prefill(one_group, make_request("long", 4096, max_tokens=8))[-1] == [256]
    step(one_group)
    assert one_group.make_stats().kv_blocks_used == 257 and one_group.make_stats().kv_blocks_used_per_group == []


@pytest.fixture(scope="module")
def gemma_model() -> str:
    from engine.model.source import resolve_source

    try:
        resolve_source("gemma3-270m")
    except ValueError as e:
        pytest.skip(str(e))
    return "gemma3-270m"


@pytest.mark.serial  # a real Gemma 3 model (and HF's copy): GBs of memory, run alone (issue 58)
@pytest.mark.slow
def test_the_gemma_engine_reports_blocks_per_group(gemma_model: str) -> None:
    """The real Gemma 3 270M engine, one 4,096-token prompt: its StepStats (steps.csv's columns)
    show 33 blocks per sliding group once it decodes, against 257 in the full group."""
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=gemma_model, dtype="float32", max_num_seqs=1, block_size=16, num_blocks=800, max_model_len=4160,
              max_num_batched_tokens=1024, quantized_decode=False)  # fmt: skip
    prompt = [(i * 7919) % 20000 + 100 for i in range(4096)]
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    per_group = [s.kv_blocks_used_per_group for s in llm.step_stats]
    assert per_group[0] == [64] * 6  # the first 1,024-token chunk, every position in every group
    decoding = [g for s, g in zip(llm.step_stats, per_group, strict=True) if s.num_decode_tokens]
    assert decoding and decoding[0] == [257] + [33] * 5, per_group
    assert all(sum(g) == s.kv_blocks_used for s, g in zip(llm.step_stats, per_group, strict=True))
    llm.engine_core.scheduler.assert_idle()


def test_prefix_hit_after_the_old_window_blocks_are_evicted() -> None:
    """A request's sliding blocks before its last window are evicted (reused by another request);
    the same prompt still hits its whole prefix: the full group's blocks and the last window's."""
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), sliding_window=64))
    sched = make_grouped(groups, num_blocks=160, budget=256)
    kv = sched.kv_cache_manager
    sliding = kv.other_groups[0]
    prompt = list(range(1000, 2024))  # 64 blocks of 16
    first = make_request("a", prompt=prompt, max_tokens=3)
    _run_prefill(sched, first)
    assert kv.blocks_held("a") == [64, 20]  # the last chunk of 256 and the window before it
    step(sched)
    assert kv.blocks_held("a") == [65, 5]  # the next query's window: (64 - 1) / 16 + 1 blocks
    step(sched)  # finishes: every block back in the LRU, hashes kept
    assert not kv.req_to_blocks
    old = [sliding.key(h) for h in first.block_hashes[:58]]
    assert sum(kv.block_pool.get_cached_block(k) is not None for k in old) == 58
    # a request of other tokens takes the never-used blocks and the old window blocks, freed first
    filler = make_request("filler", prompt=list(range(5000, 5000 + 16 * 45)), max_tokens=1)
    _run_prefill(sched, filler)
    assert all(kv.block_pool.get_cached_block(k) is None for k in old), "the old window blocks were reused"
    again = make_request("b", prompt=[*prompt, 7, 8, 9], max_tokens=2)
    sched.add_request(again)  # (its block hashes)
    hit_blocks, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 1024 and len(hit_blocks.blocks) == 64
    assert [b is None for b in hit_blocks.groups[0]] == [True] * 60 + [False] * 4  # the last window: 4 blocks
    step(sched)
    assert again.num_cached_tokens == 1024 and kv.blocks_held("b") == [65, 5]
    while sched.has_unfinished_requests():
        step(sched)
    sched.schedule()
    sched.assert_idle()


def test_no_hit_past_a_missing_window_block() -> None:
    """The full group holds the prefix but the sliding group lost a block of the last window: the
    hit ends where a whole window is still cached."""
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), sliding_window=33))  # 2 blocks a window
    sched = make_grouped(groups, num_blocks=64, budget=64)
    kv = sched.kv_cache_manager
    prompt = list(range(300, 300 + 160))  # 10 blocks
    first = make_request("a", prompt=prompt, max_tokens=1)
    _run_prefill(sched, first)
    step(sched)
    sliding = kv.other_groups[0]
    kv.block_pool.evict_hash(kv.block_pool.get_cached_block(sliding.key(first.block_hashes[8])))
    again = make_request("b", prompt=[*prompt, 1], max_tokens=1)
    sched.add_request(again)
    _, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 8 * 16  # blocks 6 and 7 make the window before position 128


# ---- a hypothesis state machine with two groups ------------------------------------------------
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402
from test_scheduler_properties import SlotContent, WrittenKV  # noqa: E402

settings.register_profile("groups-ci", max_examples=150, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
settings.register_profile("groups-soak", max_examples=2000, stateful_step_count=80, deadline=None,
                          suppress_health_check=list(HealthCheck))  # fmt: skip
CORPUS = list(range(1000, 1400))
COUNTS: Counter[str] = Counter()


def check_group_books(sched: Scheduler) -> None:
    """Ref counts equal the holders in every group; the free queue holds exactly the free blocks;
    every group's list is as long as group 0's; each group's used count is its distinct blocks."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    per_group: list[set[int]] = [set() for _ in kv.groups]
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        for g in kv.other_groups:
            entries = g.req_to_blocks[rid]
            assert len(entries) == len(blocks), (rid, g.index)
            ids += [b.block_id for b in entries if b is not None]
            per_group[g.index].update(b.block_id for b in entries if b is not None)
        per_group[0].update(b.block_id for b in blocks)
        assert len(ids) == len(set(ids)), "a request holds a block twice"
        holders.update(ids)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
    free = pool.free_block_queue.get_all_free_blocks()
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert len(free) == pool.get_num_free_blocks()
    assert kv.num_used_blocks_per_group() == [len(s) for s in per_group]
    for g in kv.other_groups:
        for rid, entries in g.req_to_blocks.items():
            window = g.spec.sliding_window
            assert window is not None
            bound = g.spec.blocks_held_at_most(len(entries) * kv.block_size, kv.block_size,
                                               sched.config.max_num_batched_tokens)  # fmt: skip
            assert g.num_held(rid) <= bound, (rid, g.num_held(rid), bound)


class WrittenGroups(WrittenKV):
    """What each completed step wrote, per block slot, in every group; checks that every block a
    step reads (its window, or its whole context) is held and that hashed blocks were written."""

    def scheduled(self, sched: Scheduler, out: SchedulerOutput) -> None:
        bs, kv = self.block_size, sched.kv_cache_manager
        writes: list[tuple[int, int, SlotContent]] = []
        self.pending[id(out)] = writes
        for rid, n in out.num_scheduled_tokens.items():
            request = sched.requests[rid]
            start, end = request.num_computed_tokens - n, request.num_computed_tokens
            tables = [kv.req_to_blocks[rid], *(g.req_to_blocks[rid] for g in kv.other_groups)]
            windows = [None, *(g.window for g in kv.other_groups)]
            for table, window in zip(tables, windows, strict=True):
                first_read = 0 if window is None else max(0, start - window + 1)
                for i in range(first_read // bs, -(-end // bs)):
                    assert table[i] is not None, f"{rid}: block {i} read by the step was given back"
                if not kv.enable_caching:
                    continue
                for pos in range(start, end):
                    i = pos // bs
                    block = table[i]
                    assert block is not None
                    content = (self._parent(request, i), tuple(request.all_token_ids[i * bs : pos + 1]))
                    writes.append((block.block_id, pos % bs, content))

    @staticmethod
    def _block_hash(key: object) -> object:
        return key[:32]  # type: ignore[index]  # a group's key: the sha256 hash and the group's index


class GroupedSchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.written: WrittenGroups | None = None
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(24, 90),
        block_size=st.sampled_from([4, 8]),
        window=st.sampled_from([5, 8, 16, 21]),
        num_sliding=st.sampled_from([1, 2]),
        budget=st.integers(8, 96),
        max_num_seqs=st.sampled_from([1, 2, 4, 8]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, window: int, num_sliding: int, budget: int,
              max_num_seqs: int, caching: bool) -> None:  # fmt: skip
        groups = (KVCacheGroupSpec((0,)), *(KVCacheGroupSpec((i + 1,), window) for i in range(num_sliding)))
        self.sched = make_grouped(groups, num_blocks, block_size, budget, max_num_seqs, caching, max_model_len=512)
        self.written = WrittenGroups(block_size)
        COUNTS["machines"] += 1

    @rule(prefix=st.sampled_from([0, 8, 16, 32, 48]), tail=st.integers(0, 64), max_tokens=st.integers(1, 24),
          offset=st.integers(0, 3))  # fmt: skip
    def add(self, prefix: int, tail: int, max_tokens: int, offset: int) -> None:
        assert self.sched is not None and self.written is not None
        start = 200 + 50 * offset
        prompt = CORPUS[:prefix] + CORPUS[start : start + tail] or [CORPUS[start]]
        request = make_request(f"r{self.next_id}", prompt=prompt, max_tokens=max_tokens)
        self.next_id += 1
        self.sched.add_request(request)
        self.written.requests.append(request)
        COUNTS["requests"] += 1

    @rule(n=st.integers(1, 8))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self._answer(self._schedule())

    @precondition(lambda self: self.sched is not None and bool(self.sched.requests))
    @rule(data=st.data())
    def abort_while_in_flight(self, data: st.DataObject) -> None:
        assert self.sched is not None
        out = self._schedule()
        self.sched.abort_requests([data.draw(st.sampled_from(sorted(self.sched.requests)))])
        check_group_books(self.sched)
        self._answer(out)

    @precondition(lambda self: self.sched is not None and bool(self.sched.running))
    @rule()
    def failed_step(self) -> None:
        assert self.sched is not None and self.written is not None
        out = self._schedule()
        self.sched.fail_step(out, "injected fault")
        self.written.failed(out)
        COUNTS["failed_steps"] += 1

    def _schedule(self) -> SchedulerOutput:
        assert self.sched is not None and self.written is not None
        out = self.sched.schedule()
        COUNTS["steps"] += 1
        COUNTS["preemptions"] += self.sched.make_stats().num_preemptions
        self.written.scheduled(self.sched, out)
        return out

    def _answer(self, out: SchedulerOutput) -> None:
        assert self.sched is not None and self.written is not None
        self.written.completed(out)
        self.sched.update_from_output(out, fake_runner_output(self.sched, out))

    @invariant()
    def books_balance(self) -> None:
        if self.sched is not None:
            check_group_books(self.sched)

    @invariant()
    def every_hashed_block_was_written(self) -> None:
        if self.sched is not None and self.written is not None:
            self.written.check(self.sched)

    def teardown(self) -> None:
        sched = self.sched
        if sched is None:
            return
        for _ in range(5000):
            if not sched.has_unfinished_requests():
                break
            self._answer(self._schedule())
            check_group_books(sched)
        else:
            raise AssertionError("the scheduler did not drain in 5000 steps (livelock?)")
        sched.schedule()
        sched.assert_idle()


GroupedSchedulerMachine.TestCase.settings = settings.get_profile(
    "groups-soak" if os.environ.get("HYPOTHESIS_PROFILE") == "soak" else "groups-ci")
TestGroupedSchedulerProperties = GroupedSchedulerMachine.TestCase


def test_zz_grouped_totals(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints what the machine exercised; fails if it exercised nothing."""
    if COUNTS["machines"] == 0:
        pytest.skip("the state machine did not run in this session (deselected)")
    with capsys.disabled():
        print("\nscheduler properties, two or three KV cache groups:", dict(sorted(COUNTS.items())))
    assert COUNTS["requests"] > 0 and COUNTS["steps"] > 0 and COUNTS["preemptions"] > 0



def test_the_simulator_counts_blocks_as_the_engine_does() -> None:
    """engine/sim: a block of the gemma-3-27b shape is one group's 10 layers of 62, and its
    scheduler allocates by the same groups (a long request holds a window per sliding group)."""
    from engine.config import EngineConfig
    from engine.sim.executor import SimulatedExecutor
    from engine.sim.hardware import HardwareProfile
    from engine.sim.kv_capacity import arch_kv_groups, kv_bytes_per_token, kv_capacity
    from engine.sim.model_counts import load_arch

    arch, hw = load_arch("gemma-3-27b"), HardwareProfile.load("h200")
    groups = arch_kv_groups(arch)
    assert [len(g.layers) for g in groups] == [10, 10, 10, 10, 10, 10, 2] and groups[1].sliding_window == 1024
    per_token = 2 * arch.num_kv_heads * arch.head_dim * 2  # bf16
    assert kv_bytes_per_token(arch, 1, "bf16") == 10 * per_token
    assert kv_capacity(arch, hw).block_bytes == 16 * 10 * per_token
    llama = load_arch("llama-3-8b")
    assert kv_bytes_per_token(llama, 1, "bf16") == 2 * llama.num_layers * llama.num_kv_heads * llama.head_dim * 2
    config = EngineConfig()
    config.cache.num_blocks = 4000
    executor = SimulatedExecutor.from_names(config, "gemma-3-27b", "h200")
    executor.initialize()
    assert executor.kv_cache_groups == groups
