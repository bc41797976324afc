"""A snapshot of the scheduler for one step (EngineCore turns it into a StepStats)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.kv_transfer.metadata import KVConnectorOutput
    from engine.step_io import SchedulerOutput


@dataclass(slots=True)
class SchedulerStats:
    """Field names equal those of `engine.outputs.StepStats`, so that
    `StepStats(step=..., time=..., **stats.as_dict())` works. Per-step counters
    cover the last `schedule()` and the `update_from_output()` that followed it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # With several KV cache groups (engine/kv_cache_spec.py), the blocks each holds (sum:
    # kv_blocks_used); empty with one group.
    kv_blocks_used_per_group: list[int] = field(default_factory=list)
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

    def with_state(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
                   kv_blocks_used_per_group: list[int] | None = None) -> SchedulerStats:
        """A copy of these counters with the scheduler's state columns set (its own list)."""
        return replace(self, num_running=num_running, num_waiting=num_waiting, kv_blocks_used=kv_blocks_used,
                       kv_blocks_total=kv_blocks_total, kv_blocks_used_per_group=kv_blocks_used_per_group or [],
                       num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def add_step_output(self, out: SchedulerOutput) -> None:
        """The counters one SchedulerOutput carries (prefix cache, prefill / decode split)."""
        self.prefix_cache_queries, self.prefix_cache_hits = out.prefix_cache_queries, out.prefix_cache_hits
        self.num_prefill_tokens, self.num_decode_tokens = out.num_prefill_tokens, out.num_decode_tokens
        self.num_prefill_reqs, self.num_decode_reqs = out.num_prefill_reqs, out.num_decode_reqs

    def add_verified_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One request verified `num_drafts` draft tokens, the first `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_accepted - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def add_connector_output(self, output: KVConnectorOutput, external_hit_tokens: int, load_failures: int) -> None:
        """What the worker's KV connector moved this step, and the loads' hits and failures."""
        self.kv_blocks_loaded += output.num_blocks_loaded
        self.kv_blocks_saved += output.num_blocks_saved
        self.kv_bytes_loaded += sum(output.bytes_loaded.values())
        self.kv_bytes_saved += sum(output.bytes_saved.values())
        self.kv_load_time += output.load_time
        self.kv_save_time += output.total_save_time
        self.kv_external_hit_tokens += external_hit_tokens
        self.kv_load_failures += load_failures

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


_FIELDS = tuple(f.name for f in fields(SchedulerStats))
KV_CONNECTOR_STATS = tuple(name for name in _FIELDS if name.startswith("kv_")
                           and name not in ("kv_blocks_used", "kv_blocks_total", "kv_blocks_used_per_group"))
