"""BlockPool and its free queue (SCENARIOS 18, 22, 26)."""

from __future__ import annotations

import pytest

from engine.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.core.kv_cache.hashing import hash_block_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_primitives_keep_links_consistent() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]

    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # middle
    q.remove(blocks[5])  # tail
    assert ids(q.get_all_free_blocks()) == [1, 2, 4] and len(q) == 3
    assert blocks[3].prev_free is None and blocks[3].next_free is None

    q.append(blocks[3])
    q.appendleft(blocks[5])
    q.append_n([blocks[0]])
    assert ids(q.get_all_free_blocks()) == [5, 1, 2, 4, 3, 0]
    assert ids(q.popleft_n(4)) == [5, 1, 2, 4]
    assert ids(q.get_all_free_blocks()) == [3, 0] and len(q) == 2


def test_free_queue_errors_are_clear() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(ValueError, match="asked for 3"):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError, match="no free KV cache blocks"):
        q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    assert len(q) == 0 and q.get_all_free_blocks() == []


def test_get_new_blocks_touch_and_free_ref_counts() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and pool.get_num_free_blocks() == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 0) and pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_eviction_order_unhashed_then_never_used_then_lru_cached() -> None:
    pool = BlockPool(8)
    req = pool.get_new_blocks(3)  # ids 0, 1, 2: two full cached blocks + a partial one
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    assert pool.cache_block(req[0], h0, [1, 2]) and pool.cache_block(req[1], h1, [3, 4])
    pool.free_blocks(reversed(req))  # tail first
    order = ids(pool.free_block_queue.get_all_free_blocks())
    # Unhashed partial block 2 first, never-used 3..7, then the cached ones tail first.
    assert order == [2, 3, 4, 5, 6, 7, 1, 0]
    # A freed cached block can still be hit until evicted.
    assert pool.get_cached_block(h0) is req[0] and pool.get_cached_block(h1) is req[1]

    taken = pool.get_new_blocks(7)
    assert ids(taken) == [2, 3, 4, 5, 6, 7, 1]
    assert pool.get_cached_block(h1) is None and req[1].block_hash is None  # evicted
    assert pool.get_cached_block(h0) is req[0]  # least recent eviction candidate left


def test_hit_block_leaves_free_queue_and_reuse_drops_old_hash() -> None:
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [9, 9])
    pool.cache_block(blk, h, [9, 9])
    pool.free_blocks([blk])
    pool.touch([blk])  # a prefix hit on a free cached block
    assert blk.ref_cnt == 1 and blk not in pool.free_block_queue.get_all_free_blocks()
    others = pool.get_new_blocks(2)
    assert blk not in others and pool.get_num_free_blocks() == 0
    pool.free_blocks([blk, *others])
    # New content: the pool hands out the unhashed blocks first, then the cached one, dropping its hash.
    reused = pool.get_new_blocks(3)
    assert reused[-1] is blk and blk.block_hash is None and pool.get_cached_block(h) is None


def test_duplicate_hash_keeps_first_block_and_reset_needs_all_free() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5])
    assert pool.cache_block(a, h, [5])
    assert not pool.cache_block(b, h, [5]) and b.block_hash is None
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and a.block_hash is None
