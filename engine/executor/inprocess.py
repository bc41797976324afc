"""The in-process executor: one worker, in this process."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)

    def initialize(self) -> int:
        num_blocks = self.worker.load_and_allocate()
        self.max_model_len = self.worker.max_model_len
        self.eos_token_id = self.worker.arch.eos_token_id
        self.vocab_size = self.worker.arch.vocab_size
        self.compile_time = self.worker.compile_time
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    @property
    def model_runner(self) -> ModelRunner | None:
        return self.worker.model_runner
