"""KV loads off the engine loop: one background thread per worker-side connector.

The worker half hands each load (`BlockTransfer`) to `LoadThread.submit` and returns at once;
the thread runs the connector's `load(transfer)` (fetch from the store, then write into the
device blocks the scheduler allocated for it) and queues a `LoadResult`. The worker half
collects finished results in `get_finished`, so the scheduler learns of a load one or more steps
after it started, while the requests that do not wait for it keep stepping.

Why a single thread: loads into the device cache of one engine are few and I/O bound; one
thread keeps the writes into the KV tensor in the order they were planned, and a store client
(Mooncake's) sees one caller at a time from the worker side.

Safety rests on the scheduler: the blocks a load writes belong to a request in
WAITING_FOR_REMOTE_KVS, which no step reads and which are not registered in the prefix cache
until the load reports; a request aborted meanwhile keeps them until then (remote_kv.py). So a
load is never cut short: `close` waits for the thread, and a load the store never answers holds
its blocks for as long as the store's own timeouts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_transfer.metadata import BlockTransfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One finished load: `error` None and `nbytes` moved, or the error's text (recompute)."""

    req_id: str
    num_blocks: int
    nbytes: int
    seconds: float
    error: str | None = None


class LoadThread:
    """Runs `load(transfer) -> bytes moved` for each submitted transfer, in order, on one thread."""

    def __init__(self, load: Callable[[BlockTransfer], int], name: str = "kv-load") -> None:
        self._load = load
        self._todo: queue.SimpleQueue[BlockTransfer | None] = queue.SimpleQueue()
        self._done: list[LoadResult] = []
        self._lock = threading.Lock()
        self._finished = threading.Event()  # set when a result is queued, cleared by `collect`
        self._in_flight = 0  # submitted and not collected (touched by the submitting thread only)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, transfer: BlockTransfer) -> None:
        self._in_flight += 1
        self._todo.put(transfer)

    @property
    def num_in_flight(self) -> int:
        """Loads submitted whose result was not collected yet."""
        return self._in_flight

    def collect(self) -> list[LoadResult]:
        """Results finished since the last call (never blocks)."""
        with self._lock:
            done, self._done = self._done, []
            self._finished.clear()
        self._in_flight -= len(done)
        return done

    def wait(self, timeout_s: float) -> None:
        """Block until a result is ready to collect, at most `timeout_s`."""
        if self._in_flight:
            self._finished.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the loads already submitted, then stop the thread."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("kv load thread still busy after %.0f s at shutdown; left to the process exit", timeout_s)

    def _run(self) -> None:
        while True:
            transfer = self._todo.get()
            if transfer is None:
                return
            t0 = time.perf_counter()
            try:
                nbytes, error = self._load(transfer), None
            except Exception as exc:  # a failed load is recomputed, never used
                nbytes, error = 0, f"{type(exc).__name__}: {exc}"
            result = LoadResult(transfer.req_id, len(transfer), nbytes, time.perf_counter() - t0, error)
            with self._lock:
                self._done.append(result)
                self._finished.set()
