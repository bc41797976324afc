"""EngineCore: the schedule -> execute -> update loop, one step at a time.

It owns the scheduler and the executor and nothing else: tokenization and
detokenization live in the front end (`LLM`, `AsyncLLM`). Every timestamp comes
from `executor.clock()`, so the simulated executor gives a simulated timeline.

With `SchedulerConfig.async_scheduling`, `step()` is `step_with_batch_queue()`
(vLLM V1's name): a queue of at most BATCH_QUEUE_DEPTH submitted steps. Each call
schedules and submits one more step while there is room and work, and otherwise
waits for the oldest step and applies its output. In the steady state one call
schedules step N+1 (and prepares its inputs) while step N computes on the
executor's thread, then waits for step N: the scheduler, input preparation and the
front end's output processing overlap the model. Outputs lag by one call; a call
that only filled the queue returns no outputs and no stats.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sched.scheduler import Scheduler
from engine.core.sched.stats import SchedulerStats
from engine.core.step_stats import async_step_stats, step_members, step_stats
from engine.executor import make_executor
from engine.executor.base import Executor
from engine.hooks import NULL_HOOKS, StepHooks, observe_attention
from engine.kv_cache_spec import KVCacheGroupSpec
from engine.kv_transfer.base import KVConnectorBase, KVConnectorRole
from engine.kv_transfer.factory import create_kv_connector
from engine.request import Request, RequestStatus
from engine.seam import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, StepMember
from engine.spec_decode.proposer import NgramProposer
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# Steps in flight with async scheduling: the one computing and the one being prepared.
BATCH_QUEUE_DEPTH = 2


@dataclass(slots=True)
class _InFlightStep:
    """A submitted step waiting for its output (async scheduling)."""

    step: int
    scheduler_output: SchedulerOutput
    future: Future[ModelRunnerOutput]
    sched_stats: SchedulerStats  # the scheduler's counters right after this step's schedule()
    schedule_time: float
    depth: int  # steps in flight once this one was submitted (itself included)
    members: list[StepMember]  # its requests, taken at its schedule()


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        config.validate()
        self.config = config
        if executor is None:
            executor = make_executor(config)
        self.executor = executor
        self.num_blocks = executor.initialize()
        self.max_model_len = executor.max_model_len
        # (an executor made outside engine/executor/ may not say: one group)
        self.kv_cache_groups: tuple[KVCacheGroupSpec, ...] = getattr(executor, "kv_cache_groups", ())
        self.eos_token_id = executor.eos_token_id
        self.kv_connector = self._make_kv_connector(config, executor)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_blocks, self.max_model_len, clock=executor.clock,
            kv_connector=self.kv_connector, kv_cache_groups=self.kv_cache_groups,
        )
        self.hooks: StepHooks = NULL_HOOKS
        self.step_index = 0
        self.batch_queue: deque[_InFlightStep] | None = deque() if config.scheduler.async_scheduling else None
        self._failed_outputs: list[EngineCoreOutput] = []  # of the requests the last failed step ended
        runner = getattr(executor, "model_runner", None)
        self._runner = runner
        # Grammars compile on the manager's thread; the tokenizer is loaded there on first use.
        self.structured_output = StructuredOutputManager(
            lambda: _tokenizer_source(config), config.structured_outputs_config
        )
        spec = config.speculative_config
        self.proposer: NgramProposer | None = NgramProposer(spec) if spec.enabled else None

    @staticmethod
    def _make_kv_connector(config: EngineConfig, executor: Executor) -> KVConnectorBase | None:
        """The scheduler half of `kv_transfer.kv_connector` (the worker builds its own half)."""
        if config.kv_transfer.kv_connector is None:
            return None
        bytes_per_block = getattr(executor, "kv_bytes_per_block", 0)
        if not bytes_per_block:
            raise ValueError("kv_transfer: this executor has no KV cache to connect a store to")
        return create_kv_connector(config, KVConnectorRole.SCHEDULER, bytes_per_block)

    def set_hooks(self, hooks: StepHooks) -> None:
        """Install observation hooks (profiler) in the core and the model runner."""
        self.hooks = hooks
        if self._runner is not None:
            self._runner.hooks = hooks
            backend = getattr(self._runner, "attn_backend", None)
            if backend is not None:
                observe_attention(backend, hooks)

    # ---- requests --------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            max_tokens=req.max_tokens,
        )
        if req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
        elif self.batch_queue is not None:
            self.scheduler.reject_request(request, "structured_outputs: not supported with async_scheduling yet")
        else:
            self.structured_output.submit(request)  # queued once its grammar is compiled

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self.structured_output.abort(ids)
        self.scheduler.abort_requests(ids)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests the front end decided are done (stop strings)."""
        ids = list(request_ids)
        self.structured_output.abort(ids)
        self.scheduler.finish_requests(ids, status)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash (False while blocks are still in use)."""
        return self.scheduler.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """A request is left, or a step is still in flight (its output must be applied)."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.batch_queue)
            or self.structured_output.num_awaiting > 0
        )

    def clock(self) -> float:
        return self.executor.clock()

    # ---- the step --------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One iteration: schedule, execute, update. Returns outputs and this step's stats.

        With async scheduling: `step_with_batch_queue()`."""
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        self._admit_compiled()
        sched = self.scheduler
        if self.structured_output.num_awaiting and not sched.has_unfinished_requests() and not sched.finished_req_ids:
            return EngineCoreOutputs(outputs=[], stats=None, timestamp=self.clock())  # only grammars compiling
        step = self.step_index
        self.hooks.step_begin(step)
        c0 = self.clock()
        t0 = time.perf_counter()
        with self.hooks.phase("schedule"):
            so = self.scheduler.schedule()
            so.grammar_bitmask = self.structured_output.fill_bitmask(so.num_scheduled_tokens, self.scheduler.requests)
            members = step_members(so, self.scheduler.requests)
        t1 = time.perf_counter()
        if so.total_num_scheduled_tokens > 0 or so.finished_req_ids or so.has_connector_work:
            try:
                runner_out = self.executor.execute_model(so)
            except Exception as exc:
                # The scheduler must not wait for an answer to this step: its requests fail
                # (`take_failed_outputs`), the prefix-cache entries it never wrote are dropped,
                # and the blocks it held back are freed. The caller decides about the others
                # (the offline LLM goes on; the server fails its in-flight ones).
                self._failed_outputs = self.scheduler.fail_step(so, _failure_text(exc))
                self.hooks.step_end()
                raise
        else:
            runner_out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        t2 = time.perf_counter()
        with self.hooks.phase("update"):
            outputs = self.scheduler.update_from_output(so, runner_out)
            self._after_update(outputs)
        t3 = time.perf_counter()
        delay = self.config.scheduler.step_delay_ms
        if delay > 0:
            time.sleep(delay / 1000.0)
        t4 = time.perf_counter()
        now = self.clock()
        stats = step_stats(step, now, runner_out, self.scheduler.make_stats(), schedule_time=t1 - t0,
                           update_time=t3 - t2, step_time=t4 - t0, members=members)
        stats.step_time = now - c0  # on the executor's clock: simulated runs report simulated steps
        self.hooks.step_end()
        self.step_index += 1  # every step with stats has its own index (steps.csv, kernels.csv join on it)
        return EngineCoreOutputs(outputs=outputs, stats=stats, timestamp=now)

    def take_failed_outputs(self) -> EngineCoreOutputs:
        """After `step()` raised: the final outputs (FINISHED_ERROR) of the requests the failed
        step ended; each is handed out once."""
        outputs, self._failed_outputs = self._failed_outputs, []
        return EngineCoreOutputs(outputs=outputs, stats=None, timestamp=self.clock())

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready (fail those whose grammar failed). With
        nothing else to do, wait briefly for a compile instead of spinning."""
        manager = self.structured_output
        if not manager.num_awaiting:
            return
        if not self.scheduler.has_unfinished_requests():
            manager.wait_for_any(timeout=0.05)
        ready, failed = manager.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, error in failed:
            self.scheduler.reject_request(request, error)

    def _after_update(self, outputs: list[Any]) -> None:
        """Advance grammars with the tokens the scheduler kept; propose the next drafts."""
        manager = self.structured_output
        for out in outputs:
            if out.new_token_ids or out.finish_reason is not None:
                manager.accept_tokens(out.request_id, out.new_token_ids, out.finish_reason is not None)
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running, self.scheduler.max_model_len)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """One call of the async loop (module note): fill the batch queue, else apply the
        oldest step's output. Stats describe the step whose output this call applies."""
        queue = self.batch_queue
        assert queue is not None, "async_scheduling is off"
        self.hooks.step_begin(self.step_index)
        c0 = self.clock()
        t0 = time.perf_counter()
        so: SchedulerOutput | None = None
        sched = self.scheduler
        if len(queue) < BATCH_QUEUE_DEPTH and (sched.has_unfinished_requests() or sched.finished_req_ids):
            with self.hooks.phase("schedule"):
                so = self.scheduler.schedule()
            if so.total_num_scheduled_tokens > 0:
                self._submit(so, time.perf_counter() - t0)
                if len(queue) < BATCH_QUEUE_DEPTH:
                    self.hooks.step_end()
                    return EngineCoreOutputs(outputs=[], stats=None, timestamp=self.clock())
            elif so.finished_req_ids:
                self.executor.submit_model(so).result()  # nothing to compute: the runner forgets them
        if not queue:  # nothing in flight: deliver what the scheduler holds (rejected requests)
            so = so or SchedulerOutput.empty()
            outputs = self.scheduler.update_from_output(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
            self.hooks.step_end()
            return EngineCoreOutputs(outputs=outputs, stats=None, timestamp=self.clock())
        entry = queue.popleft()
        try:
            runner_out = entry.future.result()
        except BaseException as exc:
            self._drop_in_flight(entry, _failure_text(exc))
            raise
        t2 = time.perf_counter()
        with self.hooks.phase("update"):
            outputs = self.scheduler.update_from_output(entry.scheduler_output, runner_out)
        t3 = time.perf_counter()
        delay = self.config.scheduler.step_delay_ms
        if delay > 0:
            time.sleep(delay / 1000.0)
        now = self.clock()
        stats = async_step_stats(entry.step, entry.sched_stats, self.scheduler.make_stats(), now, runner_out,
                                 outputs, schedule_time=entry.schedule_time, update_time=t3 - t2,
                                 depth=entry.depth, members=entry.members)
        stats.step_time = now - c0
        self.hooks.step_end()
        return EngineCoreOutputs(outputs=outputs, stats=stats, timestamp=now)

    def _submit(self, so: SchedulerOutput, schedule_time: float) -> None:
        assert self.batch_queue is not None
        sched_stats = self.scheduler.make_stats()
        future = self.executor.submit_model(so)
        depth = len(self.batch_queue) + 1
        members = step_members(so, self.scheduler.requests)
        self.batch_queue.append(_InFlightStep(self.step_index, so, future, sched_stats, schedule_time, depth, members))
        self.step_index += 1

    def _drop_in_flight(self, failed: _InFlightStep, error: str) -> None:
        """A step failed: wait for the steps behind it and fail every one of them in order (the
        step behind read the failed step's KV, so its outputs are lost too): their requests
        finish with `error`, their unwritten prefix-cache entries are dropped, their holds on
        blocks are released."""
        assert self.batch_queue is not None
        entries = [failed, *self.batch_queue]
        self.batch_queue.clear()
        self._failed_outputs = []
        for entry in entries:
            with contextlib.suppress(BaseException):  # the first failure is the one raised
                entry.future.result()
            self._failed_outputs += self.scheduler.fail_step(entry.scheduler_output, error)

    def reconfigure(
        self,
        scheduler_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """Swap in a new scheduler (other budgets, a smaller KV cache) over the loaded model.

        Only while idle. `num_blocks` may be at most the blocks the worker allocated;
        `max_num_seqs` at most the one the model runner was built for.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("reconfigure() needs an idle engine")
        sched = scheduler_config or self.config.scheduler
        cache = cache_config or self.config.cache
        if num_blocks is not None and num_blocks > self.num_blocks:
            raise ValueError(f"num_blocks: at most {self.num_blocks} were allocated")
        if sched.max_num_seqs > self.config.scheduler.max_num_seqs:
            raise ValueError("max_num_seqs: cannot grow past the model runner's batch")
        if cache.block_size != self.config.cache.block_size:
            raise ValueError("block_size: cannot change over an allocated cache")
        if self.scheduler.finished_req_ids:
            # Requests finished in the last step reach the model runner only with the next
            # SchedulerOutput: hand them over with an empty step before the scheduler goes.
            self.step()
        self.scheduler = Scheduler(sched, cache, num_blocks or self.num_blocks, self.max_model_len, clock=self.clock,
                                   kv_connector=self.kv_connector, kv_cache_groups=self.kv_cache_groups)  # fmt: skip
        self.batch_queue = deque() if sched.async_scheduling else None

    def run_until_idle(self, max_steps: int | None = None) -> list[EngineCoreOutputs]:
        """Step until no request is left (tests, simulations)."""
        results = []
        n = 0
        while self.has_unfinished_requests():
            results.append(self.step())
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return results

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.hooks.close()
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()


def _failure_text(exc: BaseException) -> str:
    return f"engine step failed: {type(exc).__name__}: {exc}"


def _tokenizer_source(config: EngineConfig) -> tuple[str, int | None]:
    """The vocabulary the grammars are compiled against: the model's own tokenizer."""
    from engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(config.model)
    return tokenizer.backend.to_str(), tokenizer.eos_token_id
