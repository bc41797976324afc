"""KV blocks, their ref counts, the LRU free queue and the prefix-cache map.

This is the mechanism; `KVCacheManager` is the policy facade over it.

A block with `ref_cnt == 0` is free and sits in the free queue, but it keeps its
hash and content (lazy eviction): a later request with the same prefix can still
hit it (`touch` takes it back out of the queue). Its hash is dropped only when
`get_new_blocks` pops it for new content.

Eviction order (the free queue, head first):
  1. blocks freed without a hash (partial or duplicate content: worthless),
  2. never-used blocks (the initial queue, in block-id order),
  3. freed cached blocks, least recently freed first; callers free a request's
     blocks tail first, so a prefix's last block goes before its first.

There is no reserved null block: every block id 0..num_blocks-1 is allocatable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.request import BlockHash


class KVCacheBlock:
    """One block of `block_size` token slots in the paged KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The tokens the hash stands for, kept to verify a hit.
        self.token_ids: tuple[int, ...] | None = None
        # Free-queue links; None when not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Every operation is O(1) per block, including removal from the middle (a prefix
    hit on a free cached block). Two sentinels avoid edge cases at the ends.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Insert at the tail (evicted last)."""
        assert self._tail.prev_free is not None
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Insert at the head (evicted first)."""
        assert self._head.next_free is not None
        self._link(block, self._head, self._head.next_free)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free KV cache blocks")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free KV cache blocks, {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue head to tail (tests and diagnostics)."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free
        return out


class BlockPool:
    """Owns every KVCacheBlock: allocation, ref counts, free queue, hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash; a second block computed with the same content stays unhashed.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full block under its hash; False if another block already holds it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the free queue head, evicting their old hashes; ref_cnt 1 each.

        ValueError when fewer are free (callers check `get_num_free_blocks` first).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self.evict_hash(block)
            block.ref_cnt = 1
        return blocks

    def evict_hash(self, block: KVCacheBlock) -> None:
        """Take a block out of the prefix cache (its content is no longer trusted)."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (out of the free queue if free)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference per block; blocks reaching 0 join the free queue. Returns how many did.

        `ordered_blocks` is in eviction order (first = evicted first among them).
        Unhashed blocks go to the head of the queue, hashed ones to the tail.
        """
        freed = 0
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed += 1
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)
        return freed

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only when no block is in use (False otherwise)."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached_block_hash_to_block.clear()
        return True
