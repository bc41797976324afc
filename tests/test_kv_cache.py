"""KVCacheManager and prefix caching (SCENARIOS 17, 19, 21-26)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sched_utils import make_request, make_scheduler, run_until_idle, step

from engine.core.kv_cache.hashing import hash_block_tokens, hash_request_blocks, make_block_hasher
from engine.core.kv_cache.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 16


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        rid, tokens, SamplingParams(), eos_token_id=2, cache_salt=salt, block_hasher=make_block_hasher(BS)
    )


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admit like the scheduler does; returns the prefix hit in tokens."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits, n) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def test_partial_block_unhashed_and_shared_prefix_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 155))  # 55 tokens
    r0 = req("r0", prompt)
    assert admit(kv, r0) == 0
    blocks0 = kv.req_to_blocks["r0"]
    assert len(blocks0) == 4
    assert [b.block_hash is not None for b in blocks0] == [True, True, True, False]

    r1 = req("r1", prompt[:48] + [1, 1, 1, 1, 1, 1, 1])
    hits, n = kv.get_computed_blocks(r1)
    assert n == 48 and list(hits.blocks) == blocks0[:3]
    new = kv.allocate_slots(r1, 7, hits, n)
    assert new is not None and len(new) == 1
    assert [b.ref_cnt for b in blocks0] == [2, 2, 2, 1]
    assert kv.get_block_ids("r1") == [*hits.get_block_ids(), *new.get_block_ids()]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (110, 48)
    kv.free(r0)
    kv.free(r1)
    kv.assert_idle()


@pytest.mark.parametrize(("num_tokens", "expected_hit"), [(32, 16), (48, 32), (40, 32), (17, 16)])
def test_full_prompt_hit_is_capped_below_num_tokens(num_tokens: int, expected_hit: int) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(200, 200 + num_tokens))
    a = req("a", prompt)
    admit(kv, a)
    hits, n = kv.get_computed_blocks(req("b", prompt))
    assert n == expected_hit and len(hits) == expected_hit // BS
    assert n <= num_tokens - 1
    kv.free(a)
    kv.assert_idle()


def test_decode_inside_block_allocates_nothing_and_boundary_hashes_full_block() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = req("r", list(range(100, 120)))  # 20 tokens: 2 blocks
    admit(kv, r)
    blocks = kv.req_to_blocks["r"]
    for t in range(12):  # sample tokens 21..32 and compute them one by one
        r.append_output_token_ids(t)
        new = kv.allocate_slots(r, 1)
        assert new is not None and len(new) == 0
        r.num_computed_tokens += 1
        full = r.num_computed_tokens == 32
        assert (blocks[1].block_hash is not None) == full
    assert blocks[1].block_hash == r.block_hashes[1]
    r.append_output_token_ids(99)  # token 33 crosses into block 2
    new = kv.allocate_slots(r, 1)
    assert new is not None and len(new) == 1 and len(kv.req_to_blocks["r"]) == 3
    kv.free(r)
    kv.assert_idle()


def test_hit_on_free_block_and_eviction_prefers_other_cached_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = req("a", list(range(100, 132))), req("b", list(range(300, 332)))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    a_block0 = kv.block_pool.get_cached_block(a.block_hashes[0])
    assert a_block0 is not None and a_block0.ref_cnt == 0

    a_block1 = kv.req_to_blocks.get("a") or kv.block_pool.get_cached_block(a.block_hashes[1])
    a2 = req("a2", list(range(100, 116)) + list(range(700, 716)))  # shares a's first block only
    hits, n = kv.get_computed_blocks(a2)
    assert n == 16 and hits.blocks[0] is a_block0
    new = kv.allocate_slots(a2, 16, hits, n)
    assert new is not None and a_block0.ref_cnt == 1
    assert a_block0 not in kv.block_pool.free_block_queue.get_all_free_blocks()
    # Free queue was [a1, a0, b1, b0]: a0 left it on the hit, so a1 (least recent) is evicted.
    assert new.blocks[0] is a_block1 and a_block1.block_hash == a2.block_hashes[1]
    assert kv.block_pool.get_cached_block(a.block_hashes[1]) is None
    assert all(kv.block_pool.get_cached_block(h) is not None for h in b.block_hashes)
    kv.free(a2)
    kv.assert_idle()


def test_failed_allocation_leaves_ref_counts_untouched() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(100, 148)))  # 3 blocks
    admit(kv, a)
    kv.free(a)
    big = req("big", list(range(100, 148)) + list(range(1000, 1040)))  # 88 tokens: 6 blocks
    hits, n = kv.get_computed_blocks(big)
    assert n == 48
    assert kv.allocate_slots(big, big.num_tokens - n, hits, n) is None
    assert [b.ref_cnt for b in hits.blocks] == [0, 0, 0]
    assert kv.num_free_blocks == 4 and (kv.prefix_cache_queries, kv.prefix_cache_hits) == (48, 0)
    assert "big" not in kv.req_to_blocks
    kv.assert_idle()


def test_free_uncaches_blocks_whose_kv_was_never_computed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    done, dropped = req("done", list(range(100, 148))), req("dropped", list(range(300, 348)))
    admit(kv, done)  # its step ran: num_computed_tokens == 48
    hits, n = kv.get_computed_blocks(dropped)
    assert kv.allocate_slots(dropped, 48, hits, n) is not None
    assert all(b.block_hash is not None for b in kv.req_to_blocks["dropped"])
    kv.free(dropped)  # preempted in the step that scheduled it: num_computed_tokens still 0
    kv.free(done)
    assert all(kv.block_pool.get_cached_block(h) is None for h in dropped.block_hashes)
    assert all(kv.block_pool.get_cached_block(h) is not None for h in done.block_hashes)
    kv.assert_idle()


def test_cache_salt_separates_prefixes() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 150))
    a = req("a", prompt, salt="tenant-1")
    admit(kv, a)
    assert kv.get_computed_blocks(req("b", prompt, salt="tenant-1"))[1] == 48
    assert kv.get_computed_blocks(req("c", prompt, salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(req("d", prompt))[1] == 0
    kv.free(a)
    kv.assert_idle()


def test_hit_is_verified_against_tokens() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(100, 120)))
    admit(kv, a)
    block = kv.req_to_blocks["a"][0]
    block.token_ids = tuple(range(16))  # as if the hash had collided with other content
    assert kv.get_computed_blocks(req("b", list(range(100, 120))))[1] == 0
    kv.free(a)
    kv.assert_idle()


def test_multi_turn_next_prompt_hits_all_but_last_partial_block() -> None:
    sched = make_scheduler()
    turn1 = make_request("t1", 40, max_tokens=10)
    sched.add_request(turn1)
    run_until_idle(sched)
    history = turn1.all_token_ids  # 50 tokens; the last sampled one never went through the model
    turn2 = make_request("t2", prompt=history + list(range(500, 505)))
    sched.add_request(turn2)
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48  # 3 full blocks of the 49 computed
    assert turn2.num_cached_tokens == 48
    run_until_idle(sched)
    sched.assert_idle()


def test_reset_prefix_cache_and_disabled_caching() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(100, 140)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", list(range(100, 140))))[1] == 0

    off = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)
    c = req("c", list(range(100, 140)))
    admit(off, c)
    assert all(b.block_hash is None for b in off.req_to_blocks["c"])
    assert off.prefix_cache_queries == 0
    off.free(c)
    off.assert_idle()


def test_assert_idle_detects_held_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(20)))
    admit(kv, a)
    assert kv.usage == 0.5 and kv.num_used_blocks == 2
    with pytest.raises(AssertionError, match="hold blocks"):
        kv.assert_idle()
    kv.free(a)
    kv.assert_idle()


def test_hashes_are_chained_and_stable_across_processes() -> None:
    tokens = list(range(1000, 1040))
    hashes = hash_request_blocks(tokens, BS, cache_salt="salt")
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[16:32])
    assert hash_request_blocks([0] + tokens[1:], BS, cache_salt="salt")[1] != hashes[1]  # chained
    code = (
        "from engine.core.kv_cache.hashing import hash_request_blocks;"
        "print(','.join(h.hex() for h in hash_request_blocks(list(range(1000, 1040)), 16, cache_salt='salt')))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == ",".join(h.hex() for h in hashes)
