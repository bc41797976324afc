"""Executors: how a step's SchedulerOutput reaches the model (engine/executor/base.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """The executor `config.parallel` asks for: one in-process worker, or one process per rank."""
    if config.parallel.uses_workers():
        from engine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from engine.executor.inprocess import InProcessExecutor

    return InProcessExecutor(config)
