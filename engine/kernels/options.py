"""This process's kernel switches: `EngineConfig.kernels` (engine/config.py `KernelsConfig`).

The worker calls `configure` with its engine's section before it loads the model; code that asks
what the kernels would run without an engine (a run's summary, the paired gate's probe) calls it
with the run's section first. Until then `current()` is the defaults with the environment's
overrides applied (`KERNEL_ENV_OVERRIDES`), as a process with no config runs.

The C++ switches that a process flips at run time (the attention op's AMX path, the decode team)
start on in C++ and are set from `current()` when their op loads, and again by `configure`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.config import KernelsConfig

_current: KernelsConfig | None = None
_listeners: list[Callable[[], None]] = []  # ops already loaded that follow the switches (`on_configure`)


def current() -> KernelsConfig:
    """The switches in force in this process."""
    global _current
    if _current is None:
        _current = KernelsConfig()
    return _current


def configure(config: KernelsConfig) -> None:
    """Make `config` (a copy of it) this process's switches; the ops already loaded follow it."""
    global _current
    config.validate()
    _current = dataclasses.replace(config)
    for listener in _listeners:
        listener()


def on_configure(listener: Callable[[], None]) -> None:
    """Call `listener` after every `configure` (a module whose loaded op holds a switch registers it)."""
    _listeners.append(listener)
