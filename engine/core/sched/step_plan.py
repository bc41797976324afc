"""StepPlan: what one `schedule()` call has decided so far, turned into a SchedulerOutput.

Requests are recorded before their `num_computed_tokens` advances, so a request
preempted later in the same step can be taken back out (`unschedule`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.kv_cache.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.step_io import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class StepPlan:
    # req_id -> tokens scheduled, in batch order.
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: dict[str, Request] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> blocks appended to each KV cache group past the first (several groups only).
    new_group_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # req_id -> draft tokens scheduled after its last known token (speculative decoding).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.new_reqs.append(request)

    def add_cached(
        self, request: Request, num_tokens: int, new_block_ids: list[int], spec_tokens: list[int] | None = None,
        new_group_block_ids: list[list[int]] | None = None,
    ) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        if spec_tokens:
            self.spec_tokens[request.request_id] = spec_tokens
        self.cached_reqs[request.request_id] = request
        self.new_block_ids[request.request_id] = new_block_ids
        if new_group_block_ids:
            self.new_group_block_ids[request.request_id] = new_group_block_ids

    def unschedule(self, request: Request) -> int:
        """Forget a running request scheduled earlier this step; returns its tokens."""
        rid = request.request_id
        self.cached_reqs.pop(rid, None)
        self.new_block_ids.pop(rid, None)
        self.new_group_block_ids.pop(rid, None)
        self.spec_tokens.pop(rid, None)
        return self.num_scheduled.pop(rid, 0)

    def to_output(self, kv: KVCacheManager, finished_req_ids: set[str]) -> SchedulerOutput:
        """Build the runner's view; call before advancing `num_computed_tokens`."""
        new = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.all_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                group_block_ids=kv.get_group_block_ids(r.request_id),
            )
            for r in self.new_reqs
        ]
        cached = CachedRequestData()
        req_ids, block_ids, computed = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        new_block_ids = self.new_block_ids
        for rid, r in self.cached_reqs.items():
            req_ids.append(rid)
            block_ids.append(new_block_ids[rid])
            computed.append(r.num_computed_tokens)
        if kv.other_groups:
            no_new: list[list[int]] = [[] for _ in kv.other_groups]
            group_ids = self.new_group_block_ids
            cached.new_group_block_ids = [group_ids.get(rid, no_new) for rid in self.cached_reqs]
        out = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(self.num_scheduled),
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            finished_req_ids=finished_req_ids | {r.request_id for r in self.preempted},
            preempted_req_ids={r.request_id for r in self.preempted},
            scheduled_spec_decode_tokens=dict(self.spec_tokens),
        )
        self._count_phases(out)
        return out

    def _count_phases(self, out: SchedulerOutput) -> None:
        num_scheduled = self.num_scheduled
        prefill_tokens = decode_tokens = prefill_reqs = decode_reqs = 0
        for reqs in (self.new_reqs, self.cached_reqs.values()):
            for r in reqs:
                n = num_scheduled[r.request_id] - len(self.spec_tokens.get(r.request_id, ()))
                if is_decode(r, n):
                    decode_tokens += 1
                    decode_reqs += 1
                else:
                    prefill_tokens += n
                    prefill_reqs += 1
        out.num_prefill_tokens += prefill_tokens
        out.num_decode_tokens += decode_tokens
        out.num_prefill_reqs += prefill_reqs
        out.num_decode_reqs += decode_reqs


def is_decode(request: Request, num_scheduled: int) -> bool:
    """Decode = computing exactly the last token of a request that has outputs (see engine/step_io.py);
    with async scheduling that last token may be an output placeholder."""
    pending = request.num_output_placeholders
    return (
        request.num_output_tokens + pending > 0
        and num_scheduled == 1
        and request.num_computed_tokens == request.num_tokens + pending - 1
    )
