"""The executor seam: EngineCore hands it a SchedulerOutput, it returns sampled tokens.

Implementations: `InProcessExecutor` (one worker in this process) and the capacity
planner's `SimulatedExecutor` (no model; a step-time model advances a virtual clock).
The EngineCore takes every timestamp from `executor.clock()` so that a simulated run
has simulated timestamps end to end.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.step_io import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def initialize(self) -> int:
        """Load the model (or its cost model), size and allocate the KV cache.

        Returns the number of KV blocks. Sets `self.max_model_len`, `self.eos_token_id`.
        """

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step for every scheduled request; sample where a request completed its input."""

    def clock(self) -> float:
        """Seconds since the epoch, on this executor's clock (virtual for simulations)."""
        return time.time()

    def shutdown(self) -> None:  # noqa: B027
        """Release devices and memory."""

    max_model_len: int
    eos_token_id: int | None
    # Seconds spent at start-up compiling / capturing the forward (enforce_eager=False), else 0.
    compile_time: float = 0.0
