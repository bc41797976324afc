"""The scheduler: spends a token budget and KV blocks, one step at a time.

Design note. There is no prefill phase and no decode phase. Every request has
`num_computed_tokens` (tokens whose KV is in the cache) catching up to
`num_tokens` (prompt + outputs). Each step gives each request
`min(num_tokens - num_computed_tokens, budget left, long-prefill cap)` tokens: a
prompt chunk, a whole prompt, the recompute of a preempted request and a
single decode token are the same operation. A request samples when a step
brings it level with its known tokens; the sampled token makes it one token
behind again.

One step (`schedule`):
 1. running requests first, in order; a request that cannot get a block preempts
    a victim (`preemption.pick_victim`: possibly itself) and retries;
 2. then, only if nobody was preempted, waiting requests in queue order
    (`request_queue`) while budget, `max_num_seqs` and blocks allow; a prefix-cache
    hit (`KVCacheManager.get_computed_blocks`) counts as already computed. Without
    chunked prefill a request must fit whole, and the queue head blocks the rest.
    Under the priority policy a head short of blocks or of a seat displaces a running
    request of lower priority (`preemption.displacement_victim`);
 3. the plan (`step_plan.StepPlan`) becomes a `SchedulerOutput`, then every
    scheduled request's `num_computed_tokens` advances by its scheduled tokens.

With a KV connector (`kv_connector`, engine/kv_transfer/), admission also asks the
connector's store for the prompt's blocks past the local hit (`remote_kv.RemoteKVWaits`:
WAITING_FOR_REMOTE_KVS while they load, holding their blocks; once loaded they are admitted
ahead of the queue on those blocks), and every SchedulerOutput carries the step's loads and
saves (`build_connector_meta`).

`update_from_output` and `fail_step` answer a step (`results.StepResults`, the results
half: sampled tokens, stops, connector reports, the in-flight bookkeeping).

Lengths: the effective limit is `min(max_model_len, num_blocks * block_size)`: a
request reaching it finishes as length-capped, so a request alone always fits in
the KV cache and preemption cannot loop forever. A prompt longer than the limit is
finished with an error at `add_request`. Without chunked prefill, a request longer
than `max_num_batched_tokens` is chunked anyway (it could never run otherwise).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache.hashing import make_block_hasher
from engine.core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager, Registration
from engine.core.sched import placeholders
from engine.core.sched.budget import TokenBudget
from engine.core.sched.output import make_output
from engine.core.sched.preemption import displacement_victim, pick_victim
from engine.core.sched.remote_kv import RemoteKVWaits
from engine.core.sched.request_queue import create_request_queue
from engine.core.sched.results import StepResults
from engine.core.sched.stats import SchedulerStats
from engine.core.sched.step_plan import StepPlan
from engine.kv_cache_spec import KVCacheGroupSpec, tokens_alone
from engine.request import Request, RequestStatus, is_finished
from engine.seam import EngineCoreOutput
from engine.step_io import SchedulerOutput

if TYPE_CHECKING:
    from engine.kv_transfer.base import KVConnectorBase


class Scheduler(StepResults):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.time,
        kv_connector: KVConnectorBase | None = None,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] = (),
    ) -> None:
        """`clock` stamps first-scheduled / first-token / finished times (the
        EngineCore passes `executor.clock` so simulated runs get simulated times).
        `kv_connector`: the scheduler half of an external KV store, or None.
        `kv_cache_groups`: the model's KV cache groups (engine/kv_cache_spec.py; the executor's
        `kv_cache_groups`); () for one group whose blocks hold every position."""
        self.config = scheduler_config
        self.async_scheduling = scheduler_config.async_scheduling
        self.block_size = cache_config.block_size
        if len(kv_cache_groups) > 1 and kv_connector is not None:
            raise ValueError("kv_transfer: a KV connector with several KV cache groups (a model with "
                             "sliding-window layers) is not supported yet")
        groups = kv_cache_groups or (KVCacheGroupSpec(()),)
        self.max_model_len = min(max_model_len, tokens_alone(groups, num_blocks, self.block_size,
                                                             scheduler_config.max_num_batched_tokens))
        self.clock = clock
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching, kv_cache_groups
        )
        self._block_hasher = (
            make_block_hasher(self.block_size) if self.kv_cache_manager.enable_caching else None
        )
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Finished or aborted since the last schedule(): the next output lists them.
        self.finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []
        # Steps scheduled but not yet answered, per request; aborted requests keep their
        # blocks until none is left.
        self._inflight: Counter[str] = Counter()
        self._deferred_free: dict[str, Request] = {}
        # Per step not yet answered (keyed by its output's id): the blocks it registered in the
        # prefix cache before writing them; a failed step takes them back (fail_step).
        self._unwritten: dict[int, tuple[SchedulerOutput, list[Registration]]] = {}
        # Finished requests whose connector saves are still running: freed on finished_sending.
        self._saving: set[str] = set()
        self._step = SchedulerStats()
        self.connector = kv_connector
        self.remote_kv = RemoteKVWaits(kv_connector, self.kv_cache_manager, clock) if kv_connector else None
        self._parked: list[Request] = []  # the store did not know yet: retried next step

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. A prompt over the length limit is finished with an
        error, reported by the next `update_from_output`."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if self._block_hasher is not None and not request.block_hashes:
            request.set_block_hasher(self._block_hasher)
        if request.num_tokens > self.max_model_len:
            self.reject_request(
                request,
                f"request has {request.num_tokens} tokens, more than the engine can hold "
                f"({self.max_model_len}: max_model_len and KV cache capacity)",
            )
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def reject_request(self, request: Request, error: str) -> None:
        """Finish a request that was never queued with an error, reported by the next
        `update_from_output`."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        request.finished_time = self.clock()
        self._pending_outputs.append(make_output(request, []))

    def abort_requests(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish waiting or running requests as aborted (unknown ids are ignored)."""
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, req_ids: Iterable[str], status: RequestStatus, error: str | None = None
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside: an abort, a stop string found by the
        detokenizer, or a failure of one request (FINISHED_ERROR with `error`).

        Returns their final EngineCoreOutputs (no new tokens); a caller that already
        knows (the front end's abort) may drop them. The next SchedulerOutput lists
        them in `finished_req_ids`. Tokens of a step in flight are dropped; its
        blocks are freed once that step is answered. Unknown ids are ignored.
        """
        if not is_finished(status):
            raise ValueError(f"{status.name} is not a finished status")
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        for rid in req_ids:
            request = self.requests.get(rid)
            if request is not None:
                request.status = status
                request.error = error
                self._finish(request, now)
                outputs.append(make_output(request, []))
        return outputs

    def _finish(self, request: Request, now: float) -> None:
        request.finished_time = now
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove_requests([request])
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        if self.remote_kv is not None:
            assert self.connector is not None
            if request in self._parked:
                self._parked.remove(request)
            if self.remote_kv.finish(request):
                return  # its load is in flight: freed when the load reports
            if self.connector.request_finished(request):
                self._saving.add(request.request_id)
                self._deferred_free[request.request_id] = request  # freed by finished_sending
                return
        if self._inflight[request.request_id] > 0:
            self._deferred_free[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the design note). Advances `num_computed_tokens`."""
        self._step = SchedulerStats()
        self.kv_cache_manager.take_prefix_counts()  # a step counts only its own admissions
        budget = TokenBudget(self.config.max_num_batched_tokens, self.config.long_prefill_token_threshold)
        plan = StepPlan()
        self._schedule_running(budget, plan)
        if not plan.preempted:
            self._schedule_waiting(budget, plan)
        if self._parked:
            for request in reversed(self._parked):
                self.waiting.prepend(request)
            self._parked = []
        out = plan.to_output(self.kv_cache_manager, self.finished_req_ids)
        self.finished_req_ids = set()
        self._step.num_kv_tokens_read = self._put_in_flight(out)
        out.prefix_cache_queries, out.prefix_cache_hits = self.kv_cache_manager.take_prefix_counts()
        self._step.add_step_output(out)
        if self.connector is not None:
            out.kv_connector_metadata = meta = self.connector.build_connector_meta(
                out, self.requests, self.kv_cache_manager.get_block_ids
            )
            self._step.kv_blocks_to_load = sum(len(t) for t in meta.loads)
            self._step.kv_blocks_to_save = sum(len(t) for t in meta.saves)
        return out

    def _grant(self, budget: TokenBudget, wanted: int) -> int:
        """Tokens a request that wants `wanted` more may take now (0: not this step)."""
        chunk = self.config.enable_chunked_prefill or wanted > self.config.max_num_batched_tokens
        if not chunk:
            return wanted if wanted <= budget.tokens_left else 0
        return budget.grant(wanted)

    def _schedule_running(self, budget: TokenBudget, plan: StepPlan) -> None:
        for request in list(self.running):
            if budget.exhausted:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier this step
            if placeholders.ends_in_flight(request, self.max_model_len):
                continue  # a step in flight computes its last token
            wanted = placeholders.tokens_wanted(request)
            n = self._grant(budget, wanted + len(request.spec_token_ids))
            if n == 0 and request.spec_token_ids:  # no room for the drafts: decode without them
                n = self._grant(budget, wanted)
            if n == 0:
                continue
            new_blocks = self._allocate_or_preempt(request, n, budget, plan)
            if new_blocks is not None:
                # Drafts the budget left room for (num_tokens_with_spec); their KV slots are
                # allocated now and rolled back in update_from_output if rejected.
                spec = request.spec_token_ids[: max(0, n - wanted)]
                plan.add_cached(request, n, new_blocks.get_block_ids(), spec, new_blocks.get_group_block_ids())
                budget.spend(n)
            request.spec_token_ids = []

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, budget: TokenBudget, plan: StepPlan
    ) -> KVCacheBlocks | None:
        """Allocate, preempting victims until it fits; None if `request` itself was preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = pick_victim(self.running, self.config.policy)
            budget.refund(plan.unschedule(victim))
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a step in flight samples for it: discarded
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.prepend(request)
        self._step.num_preemptions += 1

    def _schedule_ready_loads(self, budget: TokenBudget, plan: StepPlan) -> bool:
        """Admit requests whose external load finished, on the blocks they hold (remote_kv.py).
        True when none is left waiting (the queue may go next)."""
        assert self.remote_kv is not None
        ready = self.remote_kv.ready
        while ready and not budget.exhausted and len(self.running) < self.config.max_num_seqs:
            request = ready[0]
            num_hit = request.num_computed_tokens
            n = self._grant(budget, request.num_tokens - num_hit)
            if not n or self.kv_cache_manager.allocate_slots(request, n) is None:
                if n and not self.running:  # only other holders could make room: they give it back
                    for released in reversed(self.remote_kv.release_others(request)):
                        self.waiting.prepend(released)
                return False
            ready.pop(0)
            self.kv_cache_manager.count_admission(request, num_hit)
            self._admit(request, num_hit)
            plan.add_new(request, n)
            budget.spend(n)
        return not ready

    def _schedule_waiting(self, budget: TokenBudget, plan: StepPlan) -> None:
        if self.remote_kv is not None and self.remote_kv.ready and not self._schedule_ready_loads(budget, plan):
            return  # a loaded request waits for room: nothing behind it overtakes
        while self.waiting and not budget.exhausted:
            request = self.waiting.peek()
            if request in plan.preempted:
                return  # displaced this step for a higher priority: not back before the next
            if len(self.running) >= self.config.max_num_seqs:
                if self._displace_for(request, budget, plan):
                    continue
                return
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            if self.remote_kv is not None:
                num_external = self.remote_kv.external_hit(request, num_hit)
                if num_external is None:  # not known yet: the requests behind go ahead
                    self._parked.append(self.waiting.pop())
                    continue
                if num_external > 0:
                    if not self.remote_kv.start_load(request, hit_blocks, num_hit, num_external):
                        return  # no blocks for it: the head waits
                    self.waiting.pop()
                    continue
            n = self._grant(budget, request.num_tokens - num_hit)
            new_blocks = self.kv_cache_manager.allocate_slots(request, n, hit_blocks, num_hit) if n else None
            if new_blocks is None:
                if n and self._displace_for(request, budget, plan):
                    continue  # its hit is looked up again: the victim may have held part of it
                return  # the head waits; nothing behind it overtakes
            self.waiting.pop()
            self._admit(request, num_hit)
            plan.add_new(request, n)
            budget.spend(n)

    def _displace_for(self, request: Request, budget: TokenBudget, plan: StepPlan) -> bool:
        """Priority policy: preempt the running request `request` outranks (preemption.py);
        False when there is none, or when an admission of this step took a prefix hit on blocks
        the victim's share of this step fills (their KV would never be written): `request`
        waits a step."""
        victim = displacement_victim(request, self.running, self.config.policy)
        if victim is None or self.kv_cache_manager.shares_unwritten(victim):
            return False
        budget.refund(plan.unschedule(victim))
        self._preempt(victim)
        plan.preempted.append(victim)
        return True

    def _admit(self, request: Request, num_hit: int) -> None:
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if not request.first_scheduled_time:
            request.first_scheduled_time = self.clock()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    # ---- state queries -----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        remote = self.remote_kv.num_waiting if self.remote_kv is not None else 0
        return len(self.waiting) + len(self._parked) + remote

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, an output awaits delivery (a rejected
        request's error is delivered by the next step's update), or a KV load is in flight (an
        aborted request's blocks come back only when the worker reports its load)."""
        loading = self.remote_kv is not None and self.remote_kv.has_loads_in_flight
        return bool(self.requests) or bool(self._pending_outputs) or loading

    def has_pending_outputs(self) -> bool:
        """Outputs (rejected requests) waiting for the next `update_from_output`."""
        return bool(self._pending_outputs)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """State now plus the counters of the last schedule() and its update."""
        kv = self.kv_cache_manager
        per_group = kv.num_used_blocks_per_group() if kv.other_groups else None
        return self._step.with_state(self.num_running, self.num_waiting, kv.num_used_blocks, kv.num_blocks, per_group)

    def assert_idle(self) -> None:
        """AssertionError unless no request is left anywhere and every KV block is free."""
        assert not self.requests, f"unfinished requests: {sorted(self.requests)}"
        assert not self.running and not self.waiting, (self.running, list(self.waiting))
        assert not self._deferred_free, f"blocks awaiting a step: {sorted(self._deferred_free)}"
        assert not self._pending_outputs, "outputs not yet delivered by update_from_output"
        if self.remote_kv is not None:
            self.remote_kv.assert_idle()
        self.kv_cache_manager.assert_idle()
