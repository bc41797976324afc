"""Chained, deterministic block hashes for prefix caching.

hash(block i) = sha256(hash(block i-1) || tokens of block i || extra keys of block i)

The encoding is canonical (fixed-width little-endian token ids, length-prefixed
UTF-8 extra keys) so that every process and every run computes the same hash for
the same prefix: no Python `hash()`, no pickle. Only full blocks are hashed. The
cache salt is an extra key of the first block only: since the chain carries it,
every later block of a salted request differs too.

Hash equality is not trusted alone: the block pool keeps each cached block's token
ids and the KV cache manager compares them on a hit.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import BlockHash, BlockHasher, Request

# The parent of the first block.
ROOT_HASH: bytes = hashlib.sha256(b"servelab-kv-root-v1").digest()


def _encode_extra_keys(extra_keys: Sequence[str]) -> bytes:
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """sha256 over (parent hash, token ids, extra keys); parent None means the first block."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def block_extra_keys(request: Request, block_index: int) -> tuple[str, ...]:
    """Extra keys mixed into one block's hash: the cache salt, on the first block."""
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return ()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Hashes of every full block of a token sequence (for tests and tools)."""
    hashes: list[BlockHash] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def make_block_hasher(block_size: int) -> BlockHasher:
    """A hasher for `Request`: returns the hashes of the full blocks it does not have yet."""

    def hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        new: list[BlockHash] = []
        tokens = request.all_token_ids
        for i in range(start, len(tokens) // block_size):
            parent = hash_block_tokens(
                parent, tokens[i * block_size : (i + 1) * block_size], block_extra_keys(request, i)
            )
            new.append(parent)
        return new

    hasher.block_size = block_size  # type: ignore[attr-defined]  # see Request.set_block_hasher
    return hasher
