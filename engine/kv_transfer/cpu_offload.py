"""CPUOffloadConnector: a host-memory tier under the device KV cache.

Every full block a request computes is copied once into a fixed pool of host slots
(write-through, after the step's forward), so a block the device cache later evicts is still in
host memory; a prefix hit on it is loaded back into device blocks instead of recomputed. The
pool holds `cpu_bytes` (extra config; default 256 MiB) worth of blocks and drops the least
recently used block when full.

The scheduler half owns the index (block hash -> slot, in LRU order) and decides every slot;
the worker half owns the host tensor and only copies what the metadata says. Loads run on the
worker's load thread (base.py) while later steps save, so the slots a load reads are pinned from
the moment it is planned until the worker reports it: eviction skips them, and when every slot
is pinned a new block is simply not offloaded.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

import torch

from engine.kv_transfer.base import (
    BlockStoreConnector,
    KVConnectorRole,
    assign_save_slots,
    checked_extra_config,
)
from engine.kv_transfer.metadata import BlockTransfer, KVConnectorOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request

DEFAULT_CPU_BYTES = 256 << 20


class CPUOffloadConnector(BlockStoreConnector):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, bytes_per_block: int) -> None:
        super().__init__(config, role)
        extra = checked_extra_config("CPUOffloadConnector", self.transfer_config.kv_connector_extra_config,
                                     ("cpu_bytes", "num_cpu_blocks", "async_load"))
        if "num_cpu_blocks" in extra:
            self.num_slots = int(extra["num_cpu_blocks"])
        else:
            self.num_slots = int(extra.get("cpu_bytes", DEFAULT_CPU_BYTES)) // max(bytes_per_block, 1)
        if self.num_slots < 1:
            raise ValueError("CPUOffloadConnector: cpu_bytes holds no block; raise it")
        # Scheduler side: hash -> slot, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned: Counter[int] = Counter()  # slot -> loads in flight reading it
        self._pins_of: dict[str, list[int]] = {}  # request id -> the slots its load reads
        self.host: torch.Tensor | None = None  # worker side: [slots, L, 2, bs, h, d]

    # ---- scheduler half ----------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes]) -> int | None:
        n = 0
        for h in block_hashes:
            if h not in self._index:
                break
            n += 1
        return n

    def assign_load_slots(self, block_hashes: list[bytes]) -> list[int]:
        slots = []
        for h in block_hashes:
            self._index.move_to_end(h)
            slots.append(self._index[h])
        return slots

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local_tokens: int, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, block_ids, num_local_tokens, num_external_tokens)
        planned = self._pending_loads[-1] if self._pending_loads else None
        if planned is not None and planned.req_id == request.request_id:
            self._pins_of[request.request_id] = planned.slots
            self._pinned.update(planned.slots)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        for rid in output.finished_recving:
            self._pinned.subtract(self._pins_of.pop(rid, ()))
        self._pinned += Counter()  # drop the zeros

    def _evict(self) -> int | None:
        """The least recently used slot no load is reading, taken out of the index."""
        for h, slot in self._index.items():
            if not self._pinned[slot]:
                del self._index[h]
                return slot
        return None

    def select_saves(self, transfer: BlockTransfer) -> BlockTransfer | None:
        # every slot being read by a load: that block is not offloaded
        return assign_save_slots(transfer, self._index, self._free_slots, self._evict)

    # ---- worker half -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        kv = kv_caches[0]
        pin = kv.device.type == "cuda"
        self.host = torch.zeros((self.num_slots, *self.block_shape()), dtype=kv.dtype, pin_memory=pin)

    def put_blocks(self, transfer: BlockTransfer, data: torch.Tensor) -> None:
        assert self.host is not None
        self.host[torch.tensor(transfer.slots, dtype=torch.long)] = data.to("cpu")

    def get_blocks(self, transfer: BlockTransfer) -> torch.Tensor:
        assert self.host is not None
        return self.host[torch.tensor(transfer.slots, dtype=torch.long)]
