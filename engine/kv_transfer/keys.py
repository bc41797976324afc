"""Which engines may share KV blocks: a key prefix from the weights' identity and the KV layout.

A block hash (engine/core/kv_cache/hashing.py) names the tokens a block holds, not the numbers in
it: those depend on the weights that computed them and on how the cache lays them out. The
prefix puts both in every store key, so two engines share an object only when their KV for the
same tokens is byte for byte interchangeable:

- weights: a digest of the checkpoint's content (a GGUF file, or a Hugging Face folder's
  config.json and safetensors files), never its name: two different `model.gguf` files differ.
  The digest reads each file's size, its first `HEAD_BYTES` (the GGUF header, metadata and
  tensor table; a safetensors header) and `NUM_SAMPLES` slices spread over the rest, so a start
  reads a few MiB, not the file; it is cached per process by (path, size, mtime, inode). Dummy
  weights: their seed and the architecture they are drawn for. (Two files that differ only
  between the slices share a digest; `key_prefix` in the connector's extra config overrides.)
- layout: layer count, this rank's KV-head slice of the tensor-parallel size, head size, model
  and cache dtypes, block size.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import astuple
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig

HEAD_BYTES = 8 << 20  # a Llama-3 GGUF's metadata (128k-token vocabulary and merges) fits
SAMPLE_BYTES = 64 << 10
NUM_SAMPLES = 16
DIGEST_CHARS = 16  # 64 bits of sha256: a collision between two checkpoints is not a practical risk


def file_digest(path: str | Path) -> str:
    """sha256 (hex) of a file's size, head and evenly spaced slices: content, not name or mtime."""
    st = os.stat(path)
    return _file_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES:  # slices from the end of the head to the end of the file
            last = max(size - SAMPLE_BYTES, HEAD_BYTES)
            step = (last - HEAD_BYTES) / (NUM_SAMPLES - 1)
            for i in range(NUM_SAMPLES):
                f.seek(HEAD_BYTES + round(i * step))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weights_digest(config: EngineConfig) -> str:
    """The identity of the weights `config.model` runs (see the module note)."""
    from engine.model.loader import resolve_model, resolve_source

    m = config.model
    source = resolve_source(m.model)
    if m.load_format == "dummy" or source.kind == "shape":
        arch = resolve_model(m)[0]
        text = f"dummy seed={m.seed} arch={astuple(arch)!r}"
        return hashlib.sha256(text.encode()).hexdigest()
    if source.kind == "gguf":
        return file_digest(source.path)
    h = hashlib.sha256()  # a Hugging Face folder: its config and every weights file, by name
    for f in sorted(source.path.iterdir()):
        if f.name == "config.json" or ".safetensors" in f.name:
            h.update(f"{f.name}:{file_digest(f)};".encode())
    return h.hexdigest()


def default_key_prefix(config: EngineConfig, rank: int = 0) -> str:
    """`servelab/<name>@<weights digest>/L<layers>-tp<size>r<rank>-kvh<first>+<count>-d<head_dim>/
    <dtype>-<cache dtype>/bs<block size>/` for tensor-parallel rank `rank`."""
    from engine.distributed.sharding import head_split
    from engine.model.loader import resolve_model

    m, c = config.model, config.cache
    arch = resolve_model(m)[0]
    tp = config.parallel.tensor_parallel_size
    _, (kv_first, kv_count) = head_split(arch.num_heads, arch.num_kv_heads, tp, rank)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(m.model).name) or "model"
    cache_dtype = m.dtype if c.cache_dtype == "auto" else c.cache_dtype
    return (f"servelab/{name}@{weights_digest(config)[:DIGEST_CHARS]}/L{arch.num_layers}-tp{tp}r{rank}-"
            f"kvh{kv_first}+{kv_count}-d{arch.head_dim}/{m.dtype}-{cache_dtype}/bs{c.block_size}/")  # fmt: skip


def rank_key_prefixes(config: EngineConfig, key_prefix: str | None = None) -> list[str]:
    """Every tensor-parallel rank's key prefix, rank 0 first: each rank stores and loads only its
    own KV-head slice, under its own keys. A `key_prefix` given in the extra config is kept as it
    is with one rank, and gets `tp<size>r<rank>/` appended with more (two ranks never share a key)."""
    tp = config.parallel.tensor_parallel_size
    if not key_prefix:
        return [default_key_prefix(config, rank) for rank in range(tp)]
    return [key_prefix] if tp == 1 else [f"{key_prefix}tp{tp}r{rank}/" for rank in range(tp)]


def rank_address(address: str, rank: int) -> str:
    """`tcp://host:PORT` for rank 0 is `tcp://host:PORT+rank` for rank `rank` (one socket per rank)."""
    if rank == 0:
        return address
    head, _, port = address.rpartition(":")
    if not head or not port.isdigit():
        raise ValueError(f"{address!r}: a tensor-parallel rank's address needs a port number at its end")
    return f"{head}:{int(port) + rank}"
