"""What crosses the step seam for the connector: metadata down, results back.

Both are plain dataclasses of lists, ints and bytes, so they pickle or encode like the rest of
`SchedulerOutput` / `ModelRunnerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to move between the device cache and a store.

    `block_ids[i]` holds the block whose key is `block_hashes[i]`; `slots[i]` is the store's
    own address for it when the store is slot-addressed (the CPU tier), else empty.
    """

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    slots: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class KVConnectorMetadata:
    """One step's work for the worker half: loads start before the forward, saves run after it.

    `await_loads`: loads planned by this or earlier steps have not been reported yet; the
    worker reports them as they finish, so the step runs even with nothing else in it.
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    await_loads: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.await_loads


@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step.

    `finished_recving`: requests whose load completed (successfully or not); those in
    `failed_recving` got no usable KV and recompute. `finished_sending`: requests whose
    asynchronous saves completed (the scheduler then frees blocks it held back for them).
    Per-request figures feed requests.csv; totals feed steps.csv and /metrics.
    """

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    num_blocks_loaded: int = 0
    num_blocks_saved: int = 0
    bytes_loaded: dict[str, int] = field(default_factory=dict)
    bytes_saved: dict[str, int] = field(default_factory=dict)
    save_time: dict[str, float] = field(default_factory=dict)
    load_time: float = 0.0  # seconds the loads reported this step took (all requests; off the loop when async)
    total_save_time: float = 0.0
