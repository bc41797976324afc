"""How many CPU threads `servelab-serve` gives its EngineCore (engine/entrypoints/serve.py)."""

from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig
from engine.entrypoints.serve import engine_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity (Linux)")


def _cpu_config(num_threads: int = 0) -> EngineConfig:
    cfg = EngineConfig()
    cfg.device.device = "cpu"
    cfg.device.num_threads = num_threads
    return cfg


def test_every_core_goes_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = _cpu_config()
    engine_threads(cfg)
    assert cfg.device.num_threads == len(os.sched_getaffinity(0))


def test_explicit_count_and_omp_num_threads_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = _cpu_config(num_threads=3)
    engine_threads(cfg)
    assert cfg.device.num_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = _cpu_config()
    engine_threads(cfg)
    assert cfg.device.num_threads == 0  # torch's own default, which honours OMP_NUM_THREADS
