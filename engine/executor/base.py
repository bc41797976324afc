"""The executor seam: EngineCore hands it a SchedulerOutput, it returns sampled tokens.

Implementations: `InProcessExecutor` (one worker in this process), `MultiprocExecutor`
(one worker process per tensor-parallel rank, engine/executor/multiproc.py) and the capacity
planner's `SimulatedExecutor` (no model; a step-time model advances a virtual clock).
The EngineCore takes every timestamp from `executor.clock()` so that a simulated run
has simulated timestamps end to end.

`submit_model` is the non-blocking execute (vLLM: `execute_model(..., non_block=True)`)
used by async scheduling: it returns a Future at once. Steps run in the order they
were submitted, one at a time, so a step never overlaps the previous one's reads and
writes of the KV cache. The default runs the step at once and returns a done Future.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv_cache_spec import KVCacheGroupSpec
    from engine.step_io import ModelRunnerOutput, SchedulerOutput


class ExecutorDiedError(RuntimeError):
    """The executor lost a rank (its process died or failed): no later step can run.

    Fatal for the EngineCore process: it fails the in-flight requests and exits, so the
    front end reports the engine dead (`/health` 503)."""

    fatal = True


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The KV cache groups the scheduler allocates by (engine/kv_cache_spec.py), set by
        # `initialize`; () keeps one group whose blocks hold every position.
        self.kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()

    @abstractmethod
    def initialize(self) -> int:
        """Load the model (or its cost model), size and allocate the KV cache.

        Returns the number of KV blocks. Sets `self.max_model_len`, `self.eos_token_id`.
        """

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step for every scheduled request; sample where a request completed its input."""

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start one step and return without waiting for it (see the module note)."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def clock(self) -> float:
        """Seconds since the epoch, on this executor's clock (virtual for simulations)."""
        return time.time()

    def check_health(self) -> None:  # noqa: B027
        """Raise ExecutorDiedError when the executor can no longer run a step (cheap; called when idle)."""

    def shutdown(self) -> None:  # noqa: B027
        """Release devices and memory."""

    max_model_len: int
    eos_token_id: int | None
    # Seconds spent at start-up compiling / capturing the forward (enforce_eager=False), else 0.
    compile_time: float = 0.0
