"""KVCacheManager: the scheduler's one door to KV blocks and the prefix cache.

Per request it keeps the ordered list of blocks that hold the request's tokens
(block j holds token positions j*block_size .. (j+1)*block_size - 1). Blocks are
registered in the prefix cache as soon as an allocation covers them completely:
their KV is written by the step being scheduled, before any later step reads it,
and a request scheduled in the same step reads them after the layer's KV write,
so two identical prompts admitted together share full blocks.

Registering ahead of the write is a promise the step must keep: the manager journals
every block it registers for a step (`take_registered`), and a step that never ran
takes its registrations back (`evict_unwritten`), so no later hit reads KV that was
never written.

KV cache groups (engine/kv_cache_spec.py): a model with sliding-window layers has several groups
over ONE block pool. Group 0 (full attention) is the request's list here; every further group is a
`GroupBlocks` (group_blocks.py) with a positional list of its own, as long as group 0's, whose
blocks wholly outside the window are given back as the request advances. An allocation counts and
takes the blocks of every group at once, or none; a prefix hit is the longest prefix group 0 holds
whose last window every sliding group holds too (vLLM's HybridKVCacheCoordinator); registering,
the unwritten-block journal, preemption and `free` cover every group. One group (every layer full
attention): the code paths of before, with nothing added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_cache.group_blocks import Entry, GroupBlocks
from engine.kv_cache_spec import KVCacheGroupSpec
from engine.request import BlockHash, Request

# A block registered in the prefix cache and the hash it got.
Registration = tuple[KVCacheBlock, BlockHash]


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """An immutable group of blocks handed to the scheduler (it never sees the lists): group 0's,
    and per further KV cache group its entries (None: a position outside a sliding window)."""

    blocks: tuple[KVCacheBlock, ...] = ()
    groups: tuple[tuple[Entry, ...], ...] = ()

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks] if self.blocks else []

    def get_group_block_ids(self) -> list[list[int]]:
        """Per group past the first, its block ids (a position given back reads block 0); [] with
        one group or no blocks."""
        return [[b.block_id if b is not None else 0 for b in g] for g in self.groups] if self.groups else []

    def __len__(self) -> int:
        return len(self.blocks)


_NO_BLOCKS = KVCacheBlocks()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroupSpec] = ()) -> None:  # fmt: skip
        """`groups`: the model's KV cache groups (engine/kv_cache_spec.py); () or one: a single
        group whose blocks hold every position."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.groups = tuple(groups) or (KVCacheGroupSpec(()),)
        self.other_groups = [GroupBlocks(i, spec, self.block_pool, block_size)
                             for i, spec in enumerate(self.groups[1:], 1)]  # fmt: skip
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already offered to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Blocks registered for the step being scheduled, whose KV that step writes.
        self._registered: list[Registration] = []
        # Cumulative prefix-cache counters, in tokens, counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._prefix_counts_taken = (0, 0)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_used_blocks_per_group(self) -> list[int]:
        """Distinct blocks requests hold in each group (the sum is `num_used_blocks`)."""
        others = [g.num_used_blocks for g in self.other_groups]
        return [self.num_used_blocks - sum(others), *others]

    def blocks_held(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (positions given back not counted)."""
        return [len(self.req_to_blocks.get(request_id, ())), *(g.num_held(request_id) for g in self.other_groups)]

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest verified prefix hit: (blocks, number of tokens they hold).

        The hit is capped at `num_tokens - 1` tokens, rounded down to whole blocks:
        the last token is always recomputed so the step produces its logits.
        Changes nothing (no ref counts taken until `allocate_slots`).
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None or block.token_ids != tuple(request.all_token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        if not self.other_groups or not hits:
            return KVCacheBlocks(tuple(hits)), len(hits) * bs
        num_hit = len(hits)
        while True:  # every group's hit no longer than the others' (a fixed point)
            before = num_hit
            for g in self.other_groups:
                num_hit = g.longest_hit(request, num_hit)
            if num_hit == before:
                break
        if num_hit == 0:
            return KVCacheBlocks(), 0
        entries = tuple(g.hit_entries(request, num_hit) for g in self.other_groups)
        return KVCacheBlocks(tuple(hits[:num_hit]), entries), num_hit * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `delay_cache_blocks`: an allocation for an external load: register no new block in
        the prefix cache now (`cache_blocks` registers them once their KV is loaded) and count
        no prefix-cache query (the admission after the load counts it).

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from
        `get_computed_blocks` (only on admission, when the request holds no blocks).
        Returns the newly allocated blocks (hit blocks not included), or None when
        there are not enough free blocks; then nothing changed (no ref count taken).
        The first allocation of a request counts as one prefix-cache query.
        """
        bs = self.block_size
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-total_tokens // bs)
        if req_blocks is not None and not new_computed_blocks and num_required <= len(req_blocks):
            # Fast path (most decode steps): the request's blocks already hold the tokens.
            if self.enable_caching and total_tokens // bs > self._num_cached_blocks[rid]:
                self._cache_full_blocks(request, req_blocks, total_tokens)
                for g in self.other_groups:
                    g.cache_full_blocks(request, total_tokens, self._registered)
            for g in self.other_groups:
                g.remove_skipped(rid, request.num_computed_tokens)
            return _NO_BLOCKS
        return self._allocate(request, req_blocks, total_tokens, num_required, new_computed_blocks,
                              num_new_computed_tokens, delay_cache_blocks)  # fmt: skip

    def _allocate(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        total_tokens: int,
        num_required: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_new_computed_tokens: int,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """`allocate_slots` when new blocks are needed or a prefix hit is taken."""
        computed = new_computed_blocks.blocks if new_computed_blocks else ()
        is_admission = req_blocks is None
        num_new_blocks = max(0, num_required - (len(req_blocks) if req_blocks is not None else 0) - len(computed))
        # Hit blocks that are free now leave the free queue when touched.
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0) if computed else 0
        others = self.other_groups
        if others:
            rid, num_computed = request.request_id, request.num_computed_tokens + num_new_computed_tokens
            group_hits = new_computed_blocks.groups if new_computed_blocks else ()
            group_hits = group_hits or ((),) * len(others)
            if not is_admission:
                for g in others:
                    g.remove_skipped(rid, request.num_computed_tokens)
            num_free_hits += sum(1 for hit in group_hits for b in hit if b is not None and b.ref_cnt == 0)
            num_group_blocks = sum(g.num_new_blocks(rid, num_required, num_computed, hit)
                                   for g, hit in zip(others, group_hits, strict=True))  # fmt: skip
            if num_new_blocks + num_group_blocks > self.block_pool.free_block_queue.num_free_blocks - num_free_hits:
                return None
        elif num_new_blocks > self.block_pool.free_block_queue.num_free_blocks - num_free_hits:
            return None

        if is_admission:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self._num_cached_blocks[request.request_id] = 0
            if self.enable_caching and not delay_cache_blocks:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        assert req_blocks is not None
        if computed:
            self.block_pool.touch(computed)
            req_blocks.extend(computed)
        cached_tokens = request.num_computed_tokens + num_new_computed_tokens if delay_cache_blocks else total_tokens
        if others:
            return self._allocate_groups(request, req_blocks, num_new_blocks, num_required, num_computed, group_hits,
                                         cached_tokens)  # fmt: skip
        if num_new_blocks == 0:
            self._cache_full_blocks(request, req_blocks, cached_tokens)
            return _NO_BLOCKS
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, req_blocks, cached_tokens)
        return KVCacheBlocks(tuple(new_blocks))

    def _allocate_groups(self, request: Request, req_blocks: list[KVCacheBlock], num_new_blocks: int,
                         num_required: int, num_computed: int, group_hits: tuple[tuple[Entry, ...], ...],
                         cached_tokens: int) -> KVCacheBlocks:  # fmt: skip
        """`_allocate`'s end with several groups (the pool was checked to hold every group's blocks).
        Every hit is taken before any group takes new blocks (a free hit block could be popped)."""
        rid = request.request_id
        for g, hit in zip(self.other_groups, group_hits, strict=True):
            g.take_hit(rid, hit)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, req_blocks, cached_tokens)
        news = []
        for g in self.other_groups:
            news.append(tuple(g.allocate(rid, num_required, num_computed)))
            if self.enable_caching:
                g.cache_full_blocks(request, cached_tokens, self._registered)
        if not new_blocks and not any(news):
            return _NO_BLOCKS
        return KVCacheBlocks(tuple(new_blocks), tuple(news))

    def take_prefix_counts(self) -> tuple[int, int]:
        """Prefix-cache (queries, hits), in tokens, counted since the last call."""
        q0, h0 = self._prefix_counts_taken
        self._prefix_counts_taken = (self.prefix_cache_queries, self.prefix_cache_hits)
        return self.prefix_cache_queries - q0, self.prefix_cache_hits - h0

    def count_admission(self, request: Request, num_hit: int) -> None:
        """Count the prefix-cache query of an admission on blocks the request already holds (a
        finished external load, allocated without counting one): `num_hit` tokens hit."""
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks full within its first `num_tokens` tokens (after an
        external load filled them)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None:
            self._cache_full_blocks(request, blocks, num_tokens, journal=False)  # written already
            for g in self.other_groups:
                g.cache_full_blocks(request, num_tokens, None)

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int, journal: bool = True
    ) -> None:
        """Offer the request's blocks that `num_tokens` fills (and that have a hash) to the prefix
        cache; `journal`: their KV is still to be written by the step being scheduled."""
        if not self.enable_caching:
            return
        bs = self.block_size
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = min(num_tokens // bs, len(request.block_hashes))
        if end <= start:
            return
        hashes, tokens, pool, registered = request.block_hashes, request.all_token_ids, self.block_pool, self._registered
        for i in range(start, end):
            if pool.cache_block(req_blocks[i], hashes[i], tokens[i * bs : (i + 1) * bs]) and journal:
                registered.append((req_blocks[i], hashes[i]))
        self._num_cached_blocks[rid] = end

    def take_registered(self) -> list[Registration]:
        """The blocks registered since the last call, by allocations for the step being scheduled
        (not by `cache_blocks`); the journal starts empty again."""
        registered, self._registered = self._registered, []
        return registered

    def evict_unwritten(self, registered: list[Registration]) -> set[str]:
        """The step that registered these blocks never ran: take each block that still holds the
        hash it got out of the prefix cache, held or not. Returns the ids of the requests that
        hold any of them (their KV there is missing: the caller must not let them run on it)."""
        unwritten: set[int] = set()
        for block, block_hash in registered:
            if block.block_hash == block_hash:
                self.block_pool.evict_hash(block)
                unwritten.add(block.block_id)
        if not unwritten:
            return set()
        return {rid for rid, blocks in self.req_to_blocks.items()
                if any(b.block_id in unwritten for b in blocks)
                or any(g.holds_any(rid, unwritten) for g in self.other_groups)}  # fmt: skip

    def shares_unwritten(self, request: Request) -> bool:
        """True when another request holds one of the blocks `request` registered for the step
        being scheduled (a hit taken on them by an admission behind it). Preempting `request`
        now would leave that block's KV unwritten under the other's feet."""
        if not self._registered:
            return False
        held = {b.block_id for b in self.req_to_blocks.get(request.request_id, ())}
        for g in self.other_groups:
            held.update(b.block_id for b in g.req_to_blocks.get(request.request_id, ()) if b is not None)
        return any(b.block_id in held and b.block_hash == h and b.ref_cnt > 1 for b, h in self._registered)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its prefix is evicted last).

        Blocks past `request.num_computed_tokens` that this allocation registered in
        the prefix cache lose their hash: that happens when a request is preempted
        in the very step that scheduled them, so their KV will never be written.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.ref_cnt == 1:
                self.block_pool.evict_hash(block)
        self.block_pool.free_blocks(reversed(blocks))
        for g in self.other_groups:
            g.free(request)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids of the request (its whole length)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group past the first, the request's block table; [] with one group."""
        return [g.block_ids(request_id) for g in self.other_groups]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible when no request holds a block."""
        return self.block_pool.reset_prefix_cache()

    def assert_idle(self) -> None:
        """AssertionError unless no request holds blocks, every block is free, every ref count 0."""
        assert not self.req_to_blocks, f"requests still hold blocks: {sorted(self.req_to_blocks)}"
        for g in self.other_groups:
            assert not g.req_to_blocks, f"requests still hold blocks of group {g.index}: {sorted(g.req_to_blocks)}"
            assert g.num_used_blocks == 0, f"group {g.index} counts {g.num_used_blocks} blocks used"
        pool = self.block_pool
        busy = [b for b in pool.blocks if b.ref_cnt != 0]
        assert not busy, f"blocks with ref_cnt != 0: {busy[:8]}"
        assert pool.get_num_free_blocks() == pool.num_blocks, (
            f"{pool.get_num_free_blocks()} of {pool.num_blocks} blocks free"
        )
        walked = pool.free_block_queue.get_all_free_blocks()
        assert len(walked) == pool.num_blocks, f"free queue links {len(walked)} blocks"
