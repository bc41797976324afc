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

from engine.config import KernelsConfig

_current: KernelsConfig | None = None


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
    from engine.kernels import paged_attention, planned_layers

    paged_attention.apply_options()
    planned_layers.apply_options()
