"""Observation hooks the engine calls; the workbench plugs a real profiler in.

The engine never imports `profiling/`: it calls these methods on whatever object
is installed with `EngineCore.set_hooks()` (profiling.engine_hooks.StepProfilerHooks). The default does
nothing, so an unprofiled step costs one attribute lookup per phase. Test-only behaviour plugs
in the same way and nowhere else: the paired gate's injected slowdown is a hook whose
"forward" phase spins on exit (workloads/gate_worker.py `SlowForward`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol


class StepHooks(Protocol):
    def step_begin(self, step: int) -> None: ...

    def step_end(self) -> None: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]: ...

    def close(self) -> None: ...


class NullHooks:
    """Does nothing; the default."""

    def step_begin(self, step: int) -> None:
        pass

    def step_end(self) -> None:
        pass

    def close(self) -> None:
        pass

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        return _NO_RANGE  # one shared object: a step opens ~8 phases, each a generator otherwise


_NO_RANGE = contextlib.nullcontext()
NULL_HOOKS = NullHooks()


def observe_attention(backend: Any, hooks: StepHooks) -> None:
    """Every layer's `backend.forward` runs inside `hooks.phase("attention")`.

    The model holds the backend object and calls its `forward`; an instance attribute wraps
    the class method, and NullHooks restore it (no cost when not observing).
    """
    if "forward" in vars(backend):
        del backend.forward  # a wrapper from earlier hooks
    if hooks is NULL_HOOKS:
        return
    inner = backend.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with hooks.phase("attention"):
            return inner(*args, **kwargs)

    backend.forward = forward
