"""MooncakeStoreConnector: KV blocks in Mooncake's distributed store, shared by engines.

Each full block is one object, keyed `<key_prefix><block hash hex>`; the prefix names the model,
a digest of its weights' content and the KV layout (engine/kv_transfer/keys.py), so two engines
share blocks only when their KV is interchangeable. The producer side puts every block a step fills (after the forward); the
consumer side asks `batch_is_exist` for the blocks past its local hit and gets them into its
device blocks before admitting the request. Engines in one process share one store client.

Tensor parallelism: each rank's worker half stores and loads its own KV-head slice under its own
keys (the prefix names the rank and its heads, keys.rank_key_prefixes); the scheduler half counts
a block as held only when every rank's object is there, and the ranks' reports are merged before
the scheduler sees them (engine/kv_transfer/tp_output.py).

The store is a cache, never a source of truth: any error (master unreachable, object gone, size
mismatch) makes that lookup a miss, that load a failed load (recomputed) and that save a no-op,
and the connector leaves the store alone for `retry_after_s` seconds, so a dead master costs one
timeout, not one per block.

kv_connector_extra_config (docs/kv_transfer.md): master_server_address ("127.0.0.1:50051"),
metadata_server ("http://127.0.0.1:8080/metadata"), protocol ("tcp"), local_hostname
("127.0.0.1"), global_segment_size (bytes this client lends the store, 256 MiB),
local_buffer_size (64 MiB), key_prefix (derived from the config), retry_after_s (10),
async_load (true: `get_batch` runs on the load thread, base.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.kv_transfer.base import BlockStoreConnector, KVConnectorRole, checked_extra_config
from engine.kv_transfer.keys import default_key_prefix, rank_key_prefixes  # noqa: F401 (default_key_prefix: re-exported)
from engine.kv_transfer.metadata import BlockTransfer

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

_KNOWN_KEYS = {
    "master_server_address", "metadata_server", "protocol", "local_hostname", "global_segment_size",
    "local_buffer_size", "key_prefix", "retry_after_s", "device_name", "async_load",
}  # fmt: skip

# Mooncake's error code when the master cannot be reached.
_RPC_FAIL = -900

# One client per (master, metadata server, protocol) in a process: [store, users].
_CLIENTS: dict[tuple[str, str, str], list[Any]] = {}
_CLIENTS_LOCK = threading.Lock()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_client(extra: dict[str, Any]) -> tuple[tuple[str, str, str], Any]:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise RuntimeError(
            f"MooncakeStoreConnector needs Mooncake: pip install 'servelab[kv]' "
            f"(mooncake-transfer-engine-non-cuda; Debian libibverbs1 libnuma1) ({exc})"
        ) from None
    master = str(extra.get("master_server_address", "127.0.0.1:50051"))
    metadata = str(extra.get("metadata_server", "http://127.0.0.1:8080/metadata"))
    protocol = str(extra.get("protocol", "tcp"))
    key = (master, metadata, protocol)
    with _CLIENTS_LOCK:
        entry = _CLIENTS.get(key)
        if entry is None:
            store = MooncakeDistributedStore()
            host = str(extra.get("local_hostname", "127.0.0.1"))
            rc = store.setup(
                f"{host}:{_free_port()}", metadata, int(extra.get("global_segment_size", 256 << 20)),
                int(extra.get("local_buffer_size", 64 << 20)), protocol, str(extra.get("device_name", "")), master,
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"MooncakeStoreConnector: cannot join the store at master {master} "
                                   f"(setup returned {rc}); is mooncake_master running?")  # fmt: skip
            entry = _CLIENTS[key] = [store, 0]
        entry[1] += 1
    return key, entry[0]


def _close_client(key: tuple[str, str, str], healthy: bool) -> None:
    with _CLIENTS_LOCK:
        entry = _CLIENTS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _CLIENTS[key]
    if healthy:
        entry[0].close()
    # An unhealthy client is left to the process exit: closing one whose master is gone
    # waits on the master's timeouts (tens of seconds).
    else:
        _ORPHANS.append(entry[0])


_ORPHANS: list[Any] = []


class MooncakeStoreConnector(BlockStoreConnector):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, rank: int = 0) -> None:
        """`rank`: the tensor-parallel rank whose KV slice this worker half moves (scheduler: 0)."""
        super().__init__(config, role)
        extra = checked_extra_config("MooncakeStoreConnector", self.transfer_config.kv_connector_extra_config,
                                     _KNOWN_KEYS)
        # Scheduler half: every rank's prefix (a block is held when all ranks' objects are); worker: its own.
        self.rank_prefixes = rank_key_prefixes(config, str(extra.get("key_prefix") or "") or None)
        self.key_prefix = self.rank_prefixes[rank]
        self.retry_after_s = float(extra.get("retry_after_s", 10.0))
        self._client_key, self.store = _open_client(extra)
        self._down_until = 0.0
        self._block_nbytes = 0

    def _key(self, block_hash: bytes) -> str:
        return self.key_prefix + block_hash.hex()

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _trip(self, what: str) -> None:
        if self._available():
            logger.warning("Mooncake store: %s; not using it for %.0f s (requests recompute)", what, self.retry_after_s)
        self._down_until = time.monotonic() + self.retry_after_s

    # ---- scheduler half ----------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes]) -> int | None:
        if not self._available():
            return 0
        try:  # rank 0's keys, then rank 1's, ...
            found = self.store.batch_is_exist([p + h.hex() for p in self.rank_prefixes for h in block_hashes])
        except Exception as exc:
            self._trip(f"lookup failed ({type(exc).__name__}: {exc})")
            return 0
        if any(f < 0 for f in found):
            self._trip(f"lookup failed (error {min(found)})")
            return 0
        m = len(block_hashes)
        n = 0
        while n < m and all(found[r * m + n] == 1 for r in range(len(self.rank_prefixes))):
            n += 1
        return n

    # ---- worker half -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        kv = kv_caches[0]
        self._block_nbytes = int(np.prod(self.block_shape())) * kv.element_size()

    def put_blocks(self, transfer: BlockTransfer, data: torch.Tensor) -> None:
        if not self._available():
            raise RuntimeError("store unavailable")
        raw = data.cpu().contiguous().view(torch.uint8).numpy()  # [n, block bytes]
        keys = [self._key(h) for h in transfer.block_hashes]
        rc = self.store.put_batch(keys, [memoryview(raw[i].reshape(-1)) for i in range(len(keys))])
        if rc != 0:
            if rc == _RPC_FAIL:  # the master is unreachable; a full store (-600) is only this save's loss
                self._trip(f"put returned {rc}")
            raise RuntimeError(f"put returned {rc}")

    def get_blocks(self, transfer: BlockTransfer) -> torch.Tensor:
        if not self._available():
            raise RuntimeError("store unavailable")
        values = self.store.get_batch([self._key(h) for h in transfer.block_hashes])
        sizes = [len(v) for v in values]
        if any(s != self._block_nbytes for s in sizes):  # evicted meanwhile, or the master is gone
            raise RuntimeError(f"got objects of {sizes} bytes, expected {self._block_nbytes} each")
        kv = self.kv_caches[0]
        flat = torch.frombuffer(bytearray(b"".join(values)), dtype=torch.uint8)
        return flat.view(kv.dtype).view(len(values), *self.block_shape())

    def shutdown(self) -> None:
        super().shutdown()  # the load thread first: it may be using the client
        if self._client_key is not None:
            _close_client(self._client_key, healthy=self._available())
            self._client_key = None  # type: ignore[assignment]
