"""The in-process executor: one worker, in this process.

`submit_model` (async scheduling) prepares the step's inputs on the caller's thread,
then runs its forward and sampling on one executor thread, in submission order, so the
caller schedules and prepares the next step and processes the previous one's outputs
while this one computes (torch releases the GIL inside its ops).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self._thread: ThreadPoolExecutor | None = None

    def initialize(self) -> int:
        num_blocks = self.worker.load_and_allocate()
        self.max_model_len = self.worker.max_model_len
        self.eos_token_id = self.worker.arch.eos_token_id
        self.vocab_size = self.worker.arch.vocab_size
        self.compile_time = self.worker.compile_time
        self.kv_bytes_per_block = self.worker.kv_bytes_per_block
        self.kv_cache_groups = self.worker.kv_cache_groups
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        runner = self.model_runner
        assert runner is not None, "initialize() first"
        inp = runner.prepare_step(scheduler_output)
        if inp is None:
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
            return done
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-forward")
        return self._thread.submit(runner.run_step, inp)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.worker.shutdown()

    @property
    def model_runner(self) -> ModelRunner | None:
        return self.worker.model_runner
