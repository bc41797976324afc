"""A snapshot of the scheduler for one step (EngineCore turns it into a StepStats)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class SchedulerStats:
    """Field names equal those of `engine.outputs.StepStats`, so that
    `StepStats(step=..., time=..., **stats.as_dict())` works. Per-step counters
    cover the last `schedule()` and the `update_from_output()` that followed it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    prefix_cache_queries: int = 0  # tokens queried by this step's admissions
    prefix_cache_hits: int = 0  # tokens hit by this step's admissions
    num_preemptions: int = 0
    num_finished: int = 0  # stopped or length-capped in update_from_output (not aborts)
    num_kv_tokens_read: int = 0  # sum of num_computed_tokens of the scheduled requests before the step
    num_drafts: int = 0  # requests verified with draft tokens this step (vLLM's spec_decode_num_drafts)
    num_draft_tokens: int = 0  # speculative drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted (acceptance rate = accepted / drafts)
    # Accepted drafts by position in the draft (index 0: first draft token), this step.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # KV connector (engine/kv_transfer/), this step: blocks planned, then moved by the worker.
    kv_blocks_to_load: int = 0
    kv_blocks_to_save: int = 0
    kv_blocks_loaded: int = 0
    kv_blocks_saved: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    kv_load_time: float = 0.0  # seconds the worker spent loading
    kv_save_time: float = 0.0  # seconds the worker spent saving
    kv_external_hit_tokens: int = 0  # prompt tokens whose KV a load brought (not recomputed)
    kv_load_failures: int = 0  # requests whose load failed (they recompute)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


_FIELDS = tuple(f.name for f in fields(SchedulerStats))
KV_CONNECTOR_STATS = tuple(name for name in _FIELDS if name.startswith("kv_") and name != "kv_blocks_used"
                           and name != "kv_blocks_total")  # fmt: skip
