"""Observation hooks the engine calls; the workbench plugs a real profiler in.

The engine never imports `profiling/`: it calls these methods on whatever object
is installed as `EngineCore.hooks` (or `ModelRunner.hooks`). The default does
nothing, so an unprofiled step costs one attribute lookup per phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class StepHooks(Protocol):
    def step_begin(self, step: int) -> None: ...

    def step_end(self, step: int) -> None: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]: ...


class NullHooks:
    """Does nothing; the default."""

    def step_begin(self, step: int) -> None:
        pass

    def step_end(self, step: int) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


NULL_HOOKS = NullHooks()
