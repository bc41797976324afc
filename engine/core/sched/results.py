"""The scheduler's results half: answering a step (`StepResults`, a base of `Scheduler`).

`update_from_output` appends sampled tokens, checks stops (`stop_checker`) and
frees finished requests. The caller alternates `schedule` and
`update_from_output` (each non-empty output is answered once, in order), or, with
`async_scheduling`, may call `schedule` once more before answering the previous
output: then a request's token still being sampled is an output placeholder
(`placeholders.py`), and the blocks of a request finished or aborted meanwhile are
freed only once every step that reads them is answered.

A step that never ran (the executor raised) is answered by `fail_step` instead: its
requests fail, and so do the prefix-cache entries it registered before writing them.

Every step not yet answered is counted per request (`_inflight`); a request finished or aborted
meanwhile keeps its blocks (`_deferred_free`) until the last such step is answered, or, with a
KV connector, until its asynchronous saves report (`_saving`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from engine.core.sched import placeholders
from engine.core.sched.output import make_output
from engine.core.sched.stop_checker import check_stop
from engine.request import Request, RequestStatus
from engine.seam import EngineCoreOutput
from engine.step_io import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from engine.core.kv_cache.kv_cache_manager import KVCacheManager, Registration
    from engine.core.sched.remote_kv import RemoteKVWaits
    from engine.core.sched.stats import SchedulerStats
    from engine.kv_transfer.base import KVConnectorBase
    from engine.kv_transfer.metadata import KVConnectorOutput


class StepResults:
    """The results half of `Scheduler`; its state is created by `Scheduler.__init__`."""

    requests: dict[str, Request]
    kv_cache_manager: KVCacheManager
    max_model_len: int
    async_scheduling: bool
    connector: KVConnectorBase | None
    remote_kv: RemoteKVWaits | None
    _step: SchedulerStats
    _pending_outputs: list[EngineCoreOutput]
    _inflight: Counter[str]
    _deferred_free: dict[str, Request]
    _saving: set[str]
    _unwritten: dict[int, tuple[SchedulerOutput, list[Registration]]]

    clock: Callable[[], float]

    def _finish(self, request: Request, now: float) -> None:
        raise NotImplementedError  # Scheduler's

    def finish_requests(
        self, req_ids: Iterable[str], status: RequestStatus, error: str | None = None
    ) -> list[EngineCoreOutput]:
        raise NotImplementedError  # Scheduler's

    def _put_in_flight(self, out: SchedulerOutput) -> int:
        """End of `schedule()`: count the step's tokens as computed and the step as in flight for
        each of its requests; keep the blocks it registered until it is answered. Returns the
        tokens of KV the step reads."""
        kv_read = 0
        requests, inflight, with_placeholders = self.requests, self._inflight, self.async_scheduling
        for rid, n in out.num_scheduled_tokens.items():
            request = requests[rid]
            kv_read += request.num_computed_tokens
            request.num_computed_tokens += n
            inflight[rid] += 1
            if with_placeholders:
                placeholders.add_placeholder_if_sampling(request)
        registered = self.kv_cache_manager.take_registered()
        if registered and out.total_num_scheduled_tokens:
            self._unwritten[id(out)] = (out, registered)
        return kv_read

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens.

        Returns one EngineCoreOutput per request that got tokens or finished (plus
        requests rejected at `add_request`). Tokens for a request that is no longer
        running (aborted, stopped or preempted meanwhile: with async scheduling, the
        token of a step scheduled before the stop was known) or still in a partial
        prefill are ignored; tokens after a stop in the same step are dropped, and so
        are their logprobs.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._unwritten:
            self._unwritten.pop(id(scheduler_output), None)  # the step ran: its blocks hold their KV
        if model_runner_output.kv_connector_output is not None:
            self._apply_connector_output(model_runner_output.kv_connector_output)
        now = self.clock()
        all_logprobs = model_runner_output.logprobs
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid, token_ids in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            if not token_ids:
                continue
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens < request.num_tokens:
                continue  # partial prefill: nothing to sample yet
            if request.num_output_placeholders:
                placeholders.resolve(request, len(token_ids))
            if spec and rid in spec:
                self._roll_back_rejected(request, len(spec[rid]), len(token_ids) - 1)
            kept = self._append_tokens(request, token_ids, now)
            if request.is_finished:
                self._finish(request, now)
                self._step.num_finished += 1
            logprobs = all_logprobs.get(rid) if all_logprobs else None
            outputs.append(make_output(request, kept, logprobs[: len(kept)] if logprobs else None))
        self._release_inflight(scheduler_output)
        return outputs

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Speculative decoding: schedule() counted every draft as computed; the KV of the
        rejected ones is wrong, so those slots are given back (overwritten by later steps)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self._step.add_verified_drafts(num_drafts, num_accepted)

    def _apply_connector_output(self, output: KVConnectorOutput) -> None:
        """Loads that ended rejoin the queue head; saves are credited to their requests."""
        assert self.remote_kv is not None and self.connector is not None
        self.connector.update_connector_output(output)
        self.remote_kv.apply_output(output)
        for rid, nbytes in output.bytes_saved.items():
            saver = self.requests.get(rid)
            if saver is not None:
                saver.kv_bytes_saved += nbytes
                saver.kv_save_time += output.save_time.get(rid, 0.0)
        for rid in output.finished_sending:
            self._saving.discard(rid)
            if rid in self._deferred_free and self._inflight[rid] == 0:
                self.kv_cache_manager.free(self._deferred_free.pop(rid))
        self._step.add_connector_output(output, self.remote_kv.external_hit_tokens, self.remote_kv.load_failures)
        self.remote_kv.begin_step()

    def _append_tokens(self, request: Request, token_ids: list[int], now: float) -> list[int]:
        if len(token_ids) == 1:  # the common case, without the loop
            request.append_output_token_ids(token_ids[0])
            check_stop(request, self.max_model_len)
            if not request.first_token_time:
                request.first_token_time = now
            return token_ids
        kept: list[int] = []
        for token_id in token_ids:
            request.append_output_token_ids(token_id)
            kept.append(token_id)
            if check_stop(request, self.max_model_len):
                break
        if not request.first_token_time:
            request.first_token_time = now
        return kept

    def fail_step(self, scheduler_output: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """The step `scheduler_output` planned never ran (the executor raised).

        The blocks it registered in the prefix cache lose their hashes (their KV was never
        written: a later hit would read garbage). Every live request it scheduled, and every
        live request holding one of those blocks (a hit on them by a step behind it, a load
        waiting on top of them), finishes with FINISHED_ERROR: its `num_computed_tokens`
        counts KV that is not there. The step is answered, so blocks held back for it (aborted
        requests) are freed now rather than by an update that never comes. Returns the failed
        requests' final outputs (the caller delivers them).
        """
        entry = self._unwritten.pop(id(scheduler_output), None)
        holders = self.kv_cache_manager.evict_unwritten(entry[1]) if entry else set()
        live = [rid for rid in (*scheduler_output.num_scheduled_tokens, *sorted(holders)) if rid in self.requests]
        outputs = self.finish_requests(dict.fromkeys(live), RequestStatus.FINISHED_ERROR, error)
        self._release_inflight(scheduler_output)
        return outputs

    def _release_inflight(self, scheduler_output: SchedulerOutput) -> None:
        inflight, deferred = self._inflight, self._deferred_free
        for rid in scheduler_output.num_scheduled_tokens:
            left = inflight[rid] - 1
            if left > 0:
                inflight[rid] = left
                continue
            del inflight[rid]
            if deferred and rid in deferred and rid not in self._saving:
                self.kv_cache_manager.free(deferred.pop(rid))
