"""The scheduler's side of external KV: requests whose prefix loads from a connector's store.

A waiting request at the queue head first takes its local prefix hit; the connector then says
how many more tokens its store holds (`get_num_new_matched_tokens`). With none, admission goes
on as usual. With some, the scheduler allocates blocks for local + external tokens (the external
blocks' hashes are registered only once their KV is loaded), the request leaves the queue for
WAITING_FOR_REMOTE_KVS holding those blocks, and the connector records the load.

When the worker reports the load, the request keeps its blocks (as vLLM's does): a successful
load registers the loaded blocks in the prefix cache and counts them as computed; a failed load
registered nothing, and only the local hit counts (the normal steps recompute the rest into the
same blocks: never wrong tokens; the request never asks the store again). The request is then
`ready`: the scheduler admits ready requests ahead of the waiting queue, on the blocks they hold
(`num_computed_tokens` = the tokens loaded), so KV pressure can no longer evict a load before
its request runs and have it fetched again. Holding blocks while waiting could leave the
requests behind without room with nothing running to free any; so when a ready request cannot
get its remaining blocks and nothing runs, the other ready requests give theirs back
(`release_others`: their loaded blocks stay cached, they rejoin the queue). An answer of "not
known yet" parks the request for this step so the requests behind it go ahead.

A load may take many steps (the worker runs it off the engine loop); the scheduler only learns
of it in the worker's report. Until then the engine counts as busy (`has_loads_in_flight`), so it
keeps stepping and polling even when nothing else is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from engine.kv_transfer.base import KVConnectorBase
    from engine.kv_transfer.metadata import KVConnectorOutput


class RemoteKVWaits:
    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManager, clock: Callable[[], float]) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.clock = clock
        self.waiting_for_remote: dict[str, Request] = {}
        self._local_hit: dict[str, int] = {}  # tokens hit locally when the load started
        self._num_external: dict[str, int] = {}  # tokens the load brings
        self._load_started: dict[str, float] = {}
        # Requests whose load failed: admitted without asking the store again.
        self._no_lookup: set[str] = set()
        # Finished while their load was in flight: freed when it reports.
        self._free_after_load: dict[str, Request] = {}
        # Loads reported, blocks held: admitted before the waiting queue, in report order.
        self.ready: list[Request] = []
        # Step counters, and the same since start (the engine's own counters).
        self.external_hit_tokens = 0
        self.load_failures = 0
        self.total_external_hit_tokens = 0
        self.total_load_failures = 0

    def begin_step(self) -> None:
        self.external_hit_tokens = 0
        self.load_failures = 0

    def external_hit(self, request: Request, num_local_hit: int) -> int | None:
        """Tokens the store holds past the local hit (None: not known yet)."""
        if request.request_id in self._no_lookup:
            return 0
        num, _ = self.connector.get_num_new_matched_tokens(request, num_local_hit)
        return num

    def start_load(self, request: Request, hit_blocks: KVCacheBlocks, num_local_hit: int, num_external: int) -> bool:
        """Allocate blocks for the hit and move `request` to WAITING_FOR_REMOTE_KVS.

        False (nothing changed) when the blocks are not free; the caller keeps it queued."""
        blocks = self.kv.allocate_slots(request, num_external, hit_blocks, num_local_hit, delay_cache_blocks=True)
        if blocks is None:
            return False
        rid = request.request_id
        request.num_computed_tokens = num_local_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[rid] = request
        self._local_hit[rid] = num_local_hit
        self._load_started[rid] = self.clock()
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(rid), num_local_hit, num_external)
        self._num_external[rid] = num_external
        return True

    def apply_output(self, output: KVConnectorOutput) -> None:
        """Apply the worker's report: finished loads become `ready`, holding their blocks."""
        for rid in output.finished_recving:
            request = self.waiting_for_remote.pop(rid, None)
            num_local = self._local_hit.pop(rid, 0)
            started = self._load_started.pop(rid, 0.0)
            num_external = self._num_external.pop(rid, 0)
            if request is None:
                done = self._free_after_load.pop(rid, None)
                if done is not None:
                    self.kv.free(done)
                continue
            request.kv_load_wait += self.clock() - started
            request.kv_bytes_loaded += output.bytes_loaded.get(rid, 0)
            if rid in output.failed_recving:
                self.load_failures += 1
                self.total_load_failures += 1
                self._no_lookup.add(rid)
                request.num_computed_tokens = num_local
            else:
                request.num_computed_tokens = num_local + num_external
                request.num_external_cached_tokens += num_external
                self.external_hit_tokens += num_external
                self.total_external_hit_tokens += num_external
                self.kv.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            self.ready.append(request)

    def release_others(self, keep: Request) -> list[Request]:
        """Ready requests other than `keep` give their blocks back (the loaded ones stay cached,
        so their admission may still hit them); returns them, to rejoin the waiting queue."""
        released = [r for r in self.ready if r is not keep]
        self.ready = [keep] if keep in self.ready else []
        for request in released:
            self.kv.free(request)
            request.num_computed_tokens = 0
        return released

    def finish(self, request: Request) -> bool:
        """`request` finished; True when it was waiting for a load (blocks freed later)."""
        rid = request.request_id
        self._no_lookup.discard(rid)
        if request in self.ready:
            self.ready.remove(request)
        if self.waiting_for_remote.pop(rid, None) is None:
            return False
        self._free_after_load[rid] = request
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_for_remote) + len(self.ready)

    @property
    def has_loads_in_flight(self) -> bool:
        """A load is not reported yet (its request waits, or was finished and holds its blocks)."""
        return bool(self.waiting_for_remote) or bool(self._free_after_load)

    def assert_idle(self) -> None:
        assert not self.ready, f"loaded requests not admitted: {[r.request_id for r in self.ready]}"
        assert not self.waiting_for_remote, f"requests waiting for KV: {sorted(self.waiting_for_remote)}"
        assert not self._free_after_load, f"blocks awaiting a load: {sorted(self._free_after_load)}"
