"""The connector boundary (vLLM's `KVConnectorBase_V1`), and the block-store logic both of our
connectors share.

One class, two roles: the EngineCore builds a SCHEDULER instance for the scheduler and the
worker builds a WORKER instance next to its KV cache; they talk only through
`KVConnectorMetadata` (down, in the SchedulerOutput) and `KVConnectorOutput` (up, in the
ModelRunnerOutput), so they may live in different processes.

Step protocol (scheduler half):
 1. `get_num_new_matched_tokens(request, num_local_hit)` for a waiting request: tokens past the
    local prefix hit the store holds (whole blocks, capped so at least the last prompt token is
    computed), or None when not known yet (the request waits, others go ahead);
 2. the scheduler allocates blocks for local + external tokens and calls
    `update_state_after_alloc`; the request waits in WAITING_FOR_REMOTE_KVS holding them;
 3. `build_connector_meta` at the end of `schedule()`: the loads recorded in 2 and the saves of
    blocks this step fills;
 4. `update_connector_output` with the worker's report; finished loads rejoin the queue;
 5. `request_finished`: True when the request's blocks must stay allocated until an
    asynchronous save reports in `finished_sending`.

Worker half, around one step: `bind_connector_metadata`, `start_load_kv` (before the forward),
`wait_for_layer_load(layer)`, the forward, `save_kv_layer(layer)` per layer, `wait_for_save`,
`get_finished`, `clear_connector_metadata`.

`BlockStoreConnector` implements all of that for a store of whole blocks keyed by block hash;
a store adds `lookup` (scheduler side) and `put_blocks` / `get_blocks` (worker side). Loads run
on a background thread (`load_thread.LoadThread`; extra config `async_load: false` runs them
inside the step instead): `start_load_kv` only hands them over, `get_finished` reports those
done, so a request waits in WAITING_FOR_REMOTE_KVS for as many steps as its load takes while the
others step. While loads are out, every step's metadata says `await_loads`, so the engine keeps
stepping (and the worker waits briefly for a load when the step has nothing else to do). Saves
run inside the step (complete before the step's output returns), so `request_finished` never
delays a free here; `finished_sending` keeps the boundary open for stores that save later.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.kv_transfer.load_thread import LoadResult, LoadThread
from engine.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request
    from engine.step_io import SchedulerOutput

logger = logging.getLogger(__name__)

# request id -> the ids of every block it holds (`KVCacheManager.get_block_ids`).
BlockIdsOf = Callable[[str], list[int]]


def checked_extra_config(connector: str, extra: Mapping[str, Any], known: Collection[str]) -> dict[str, Any]:
    """`kv_connector_extra_config` as a dict; ValueError naming the known keys if one is unknown."""
    unknown = set(extra) - set(known)
    if unknown:
        raise ValueError(f"{connector}: unknown kv_connector_extra_config key(s) {sorted(unknown)} "
                         f"(known: {', '.join(sorted(known))})")  # fmt: skip
    return dict(extra)


def assign_save_slots(
    transfer: BlockTransfer, index: OrderedDict[bytes, int], free_slots: list[int], evict: Callable[[], int | None]
) -> BlockTransfer | None:
    """Slot-addressed stores (the CPU tier, the transfer outbox): the blocks of `transfer` the
    store lacks, each given a slot (a free one, else `evict()`'s; None: that block is not
    stored), and recorded in `index` (hash -> slot, least recently used first). Blocks already
    held move to the end of the LRU order. None when nothing is left to save."""
    keep = BlockTransfer(transfer.req_id, [], [], [])
    for block_id, h in zip(transfer.block_ids, transfer.block_hashes, strict=True):
        if h in index:
            index.move_to_end(h)
            continue
        slot = free_slots.pop() if free_slots else evict()
        if slot is None:
            continue
        index[h] = slot
        keep.block_ids.append(block_id)
        keep.block_hashes.append(h)
        keep.slots.append(slot)
    return keep if len(keep) else None


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorBase:
    """The interface. Defaults describe a connector that holds nothing and moves nothing."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.transfer_config = config.kv_transfer
        self.role = role
        self.block_size = config.cache.block_size
        self._meta: KVConnectorMetadata | None = None

    # ---- scheduler half ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens past `num_computed_tokens` the store can load, load asynchronously?).

        None for the count means "not known yet": ask again at a later step. Changes nothing.
        """
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local_tokens: int, num_external_tokens: int
    ) -> None:
        """The scheduler allocated `block_ids` (all of the request's blocks) for a hit of
        `num_local_tokens` local plus `num_external_tokens` external tokens."""

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request], block_ids_of: BlockIdsOf
    ) -> KVConnectorMetadata:
        """This step's loads and saves; called once per `schedule()`, after the tokens of the
        scheduled requests were counted as computed. Resets the recorded loads."""
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report for a step (scheduler side bookkeeping)."""

    def request_finished(self, request: Request) -> bool:
        """The request finished; True: keep its blocks until its saves report finished."""
        return False

    # ---- worker half -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The worker's per-layer caches, each [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    def bind_connector_metadata(self, meta: KVConnectorMetadata | None) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Start (here: run) the bound metadata's loads into the KV cache."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer `layer`'s loads are in the cache (before its attention reads them)."""

    def save_kv_layer(self, layer: int) -> None:
        """Layer `layer` of this step's saves is computed: stage it for the store."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are handed to the store."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Requests whose loads / asynchronous saves completed since the last call."""
        return KVConnectorOutput()

    def wait_for_finished(self, timeout_s: float) -> None:
        """The step has nothing else to do: block until a load in flight completes, at most
        `timeout_s` (so an engine waiting only for loads does not spin)."""

    def shutdown(self) -> None:  # noqa: B027
        """Release the store's resources."""


class BlockStoreConnector(KVConnectorBase):
    """A store of whole KV blocks keyed by block hash (see the module note)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        # Scheduler side: loads recorded since the last build, requests whose load the worker
        # has not reported yet, and per request the leading blocks already in the store or
        # handed to it.
        self._pending_loads: list[BlockTransfer] = []
        self._loading: set[str] = set()
        self._saved_blocks: dict[str, int] = {}
        # Worker side.
        self.async_load = bool(self.transfer_config.kv_connector_extra_config.get("async_load", True))
        self.kv_caches: list[torch.Tensor] = []
        self._loader: LoadThread | None = None
        self._staged: list[list[torch.Tensor]] = []  # per save transfer, per layer [2, n, bs, h, d]
        self._output = KVConnectorOutput()

    # ---- store hooks -------------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes]) -> int | None:
        """How many leading blocks of `block_hashes` the store holds (None: not known yet)."""
        raise NotImplementedError

    def assign_load_slots(self, block_hashes: list[bytes]) -> list[int]:
        """Slots of blocks to load (slot-addressed stores); scheduler side."""
        return []

    def select_saves(self, transfer: BlockTransfer) -> BlockTransfer | None:
        """Drop blocks the store already has, assign slots; None when nothing is left."""
        return transfer

    def put_blocks(self, transfer: BlockTransfer, data: torch.Tensor) -> None:
        """Store `data` [n, num_layers, 2, block_size, heads, head_dim]; raise on failure."""
        raise NotImplementedError

    def get_blocks(self, transfer: BlockTransfer) -> torch.Tensor:
        """The blocks' KV as [n, num_layers, 2, block_size, heads, head_dim]; raise on a miss."""
        raise NotImplementedError

    # ---- scheduler half ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.transfer_config.is_consumer:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        if end <= start:
            return 0, False
        n = self.lookup(request.block_hashes[start:end])
        if n is None:
            return None, False
        return n * bs, n > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local_tokens: int, num_external_tokens: int
    ) -> None:
        bs = self.block_size
        first, n = num_local_tokens // bs, num_external_tokens // bs
        if n == 0:
            return
        hashes = request.block_hashes[first : first + n]
        self._pending_loads.append(
            BlockTransfer(request.request_id, block_ids[first : first + n], hashes, self.assign_load_slots(hashes))
        )
        self._loading.add(request.request_id)
        self._saved_blocks[request.request_id] = first + n  # what we load is in the store already

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request], block_ids_of: BlockIdsOf
    ) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads, await_loads=bool(self._loading))
        self._pending_loads = []
        if not self.transfer_config.is_producer:
            return meta
        saved, bs = self._saved_blocks, self.block_size
        for new in scheduler_output.scheduled_new_reqs:
            saved.setdefault(new.req_id, new.num_computed_tokens // bs)  # a local hit: saved when computed
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests[rid]
            full = min(request.num_computed_tokens // bs, len(request.block_hashes))
            start = saved.get(rid, 0)
            if full <= start:
                continue
            saved[rid] = full
            transfer = self.select_saves(
                BlockTransfer(rid, block_ids_of(rid)[start:full], request.block_hashes[start:full])
            )
            if transfer is not None and len(transfer):
                meta.saves.append(transfer)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._loading -= output.finished_recving

    def request_finished(self, request: Request) -> bool:
        self._saved_blocks.pop(request.request_id, None)
        return False

    # ---- worker half -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        if self.async_load and self._loader is None:
            self._loader = LoadThread(self._load, name=f"kv-load-{type(self).__name__}")

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        for transfer in meta.loads:
            if self._loader is not None:
                self._loader.submit(transfer)
                continue
            t0 = time.perf_counter()
            try:
                nbytes, error = self._load(transfer), None
            except Exception as exc:  # a failed load is recomputed, never used
                nbytes, error = 0, f"{type(exc).__name__}: {exc}"
            self._record_load(LoadResult(transfer.req_id, len(transfer), nbytes, time.perf_counter() - t0, error))

    def _load(self, transfer: BlockTransfer) -> int:
        """Fetch `transfer`'s blocks and write them into its device blocks; bytes moved.
        Runs on the load thread when `async_load`; raises on any failure."""
        data = self.get_blocks(transfer)
        self._scatter(transfer.block_ids, data)
        return int(data.nbytes)

    def _record_load(self, result: LoadResult) -> None:
        out = self._output
        out.finished_recving.add(result.req_id)
        out.load_time += result.seconds
        if result.error is not None:
            out.failed_recving.add(result.req_id)
            logger.warning("kv load for request %s failed (%s); it recomputes those tokens", result.req_id, result.error)
            return
        out.num_blocks_loaded += result.num_blocks
        out.bytes_loaded[result.req_id] = out.bytes_loaded.get(result.req_id, 0) + result.nbytes

    def wait_for_finished(self, timeout_s: float) -> None:
        if self._loader is not None:
            self._loader.wait(timeout_s)

    def save_kv_layer(self, layer: int) -> None:
        meta = self._meta
        if meta is None or not meta.saves:
            return
        if layer == 0:
            self._staged = [[] for _ in meta.saves]
        kv = self.kv_caches[layer]
        for staged, transfer in zip(self._staged, meta.saves, strict=True):
            staged.append(kv[:, transfer.block_ids])  # advanced indexing copies: [2, n, bs, h, d]

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or not meta.saves:
            return
        out = self._output
        for staged, transfer in zip(self._staged, meta.saves, strict=True):
            t0 = time.perf_counter()
            # [L, 2, n, bs, h, d] -> [n, L, 2, bs, h, d]
            data = torch.stack(staged).permute(2, 0, 1, 3, 4, 5).contiguous()
            try:
                self.put_blocks(transfer, data)
            except Exception as exc:  # the store misses these blocks; a later hit recomputes them
                logger.warning("kv save for request %s failed (%s: %s)", transfer.req_id, type(exc).__name__, exc)
                continue
            finally:
                dt = time.perf_counter() - t0
                out.save_time[transfer.req_id] = out.save_time.get(transfer.req_id, 0.0) + dt
                out.total_save_time += dt
            out.num_blocks_saved += len(transfer)
            out.bytes_saved[transfer.req_id] = out.bytes_saved.get(transfer.req_id, 0) + data.nbytes
        self._staged = []

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        if self._loader is not None:
            for result in self._loader.collect():
                self._record_load(result)
        out, self._output = self._output, KVConnectorOutput()
        return out

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """data [n, L, 2, bs, h, d] into the blocks `block_ids` of every layer."""
        if data.shape[1] != len(self.kv_caches) or data.shape[0] != len(block_ids):
            raise ValueError(f"stored KV has shape {tuple(data.shape)}, expected {len(block_ids)} blocks "
                             f"of {len(self.kv_caches)} layers")  # fmt: skip
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        for layer, kv in enumerate(self.kv_caches):
            kv[:, ids] = data[:, layer].transpose(0, 1).to(kv.device, kv.dtype)

    def block_shape(self) -> tuple[int, ...]:
        """One block's KV over every layer: (num_layers, 2, block_size, heads, head_dim)."""
        kv = self.kv_caches[0]
        return (len(self.kv_caches), 2, *kv.shape[2:])
