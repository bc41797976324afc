"""Adapter from the engine's profiler protocol to `StepProfiler`.

The engine never imports `profiling/`. `EngineCore.profiler` is any object with this
protocol (the engine's own default is a no-op object of the same shape):

    class EngineProfiler(Protocol):
        def step_begin(self, step: int) -> None: ...      # before schedule()
        def phase(self, name: str) -> ContextManager[None]: ...  # around one phase
        def step_end(self) -> None: ...                  # after update_from_output()
        def close(self) -> None: ...                     # engine shutdown

Phase names: schedule, prepare_inputs, forward, attention, sample, update, detokenize.
`phase()` after a step's `step_end` (the front end detokenizing that step's outputs) is
tagged with that step; before the first step it is not recorded.
The workbench builds `StepProfilerHooks(StepProfiler(run_dir, ...))` and assigns it to
`engine_core.profiler`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext

from profiling.torch_profiler import StepProfiler


class StepProfilerHooks:
    """Implements the engine profiler protocol on top of a `StepProfiler`."""

    def __init__(self, profiler: StepProfiler) -> None:
        self.profiler = profiler.start()
        self._step: int | None = None
        self._last_step: int | None = None  # a phase after step_end (detokenize) belongs to it
        self._stack = ExitStack()

    def step_begin(self, step: int) -> None:
        if self._step is not None:
            self.step_end()
        self._step = self._last_step = step
        self._stack.enter_context(self.profiler.step_range(step))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        step = self._step if self._step is not None else self._last_step
        ctx = self.profiler.phase(name, step) if step is not None else nullcontext()
        with ctx:
            yield

    def step_end(self) -> None:
        if self._step is None:
            return
        self._stack.close()
        self._step = None
        self.profiler.profiler_step()

    def close(self) -> None:
        self.step_end()
        self.profiler.finish()
