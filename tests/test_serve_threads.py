"""The defaults `servelab-serve` gives its engine (engine/entrypoints/serve.py): CPU threads,
the CPU token budget, kernel warm-up; what the user set is kept."""

from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig
from engine.entrypoints.serve import CPU_SERVING_BATCHED_TOKENS, serving_defaults

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity (Linux)")


def _cpu_config(num_threads: int = 0) -> EngineConfig:
    cfg = EngineConfig()
    cfg.device.device = "cpu"
    cfg.device.num_threads = num_threads
    return cfg


def test_every_core_goes_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = _cpu_config()
    serving_defaults(cfg)
    assert cfg.device.num_threads == len(os.sched_getaffinity(0))


def test_explicit_count_and_omp_num_threads_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = _cpu_config(num_threads=3)
    serving_defaults(cfg)
    assert cfg.device.num_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = _cpu_config()
    serving_defaults(cfg)
    assert cfg.device.num_threads == 0  # torch's own default, which honours OMP_NUM_THREADS


def test_cpu_budget_and_warm_up_defaults_unless_given() -> None:
    cfg = _cpu_config(num_threads=1)
    serving_defaults(cfg)
    assert cfg.scheduler.max_num_batched_tokens == CPU_SERVING_BATCHED_TOKENS
    assert cfg.model.warm_up_linears is True
    for explicit in ({"scheduler.max_num_batched_tokens"}, {"scheduler"}):
        cfg = _cpu_config(num_threads=1)
        cfg.scheduler.max_num_batched_tokens = 2048
        cfg.model.warm_up_linears = False
        serving_defaults(cfg, explicit)
        assert cfg.scheduler.max_num_batched_tokens == 2048 and cfg.model.warm_up_linears is False


def test_both_entry_points_report_what_the_user_set() -> None:
    from engine.entrypoints.serve import load_config

    engine, _ = load_config(["device.device=cpu", "device.num_threads=1"])
    assert engine.scheduler.max_num_batched_tokens == CPU_SERVING_BATCHED_TOKENS
    engine, _ = load_config(["device.device=cpu", "device.num_threads=1", "scheduler.max_num_batched_tokens=1024"])
    assert engine.scheduler.max_num_batched_tokens == 1024


@pytest.mark.parametrize(("flags", "expected"), [({"avx512f", "avx512_bf16"}, "bfloat16"),
                                                  ({"avx512f", "avx512_bf16", "amx_bf16"}, "bfloat16"),
                                                  ({"avx2", "fma"}, "float32")])
def test_dtype_auto_resolves_for_serving_unless_given(monkeypatch: pytest.MonkeyPatch, flags, expected) -> None:  # type: ignore[no-untyped-def]
    """A server's dtype auto: bfloat16 wherever the CPU multiplies it natively (its decode steps
    of a few rows read the weights, which bfloat16 halves), else the offline choice; a dtype the
    user asked for, or that a config file names, is kept."""
    from engine.kernels import isa

    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa, "fastest_cpu_dtype", lambda: ("float32", "offline"))
    cfg = _cpu_config(num_threads=1)
    cfg.model.dtype = "float32"  # what auto resolved to for offline use
    serving_defaults(cfg)
    assert cfg.model.dtype == expected
    for explicit, requested in [({"model.dtype"}, "auto"), (set(), "float32")]:
        cfg = _cpu_config(num_threads=1)
        cfg.model.dtype = "float32"
        serving_defaults(cfg, explicit, requested)
        assert cfg.model.dtype == "float32"


def test_entry_points_pass_the_requested_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.entrypoints.serve import load_config
    from engine.kernels import isa

    monkeypatch.setattr(isa, "serving_cpu_dtype", lambda: ("bfloat16", "test"))
    engine, _ = load_config(["device.device=cpu", "device.num_threads=1"])
    assert engine.model.dtype == "bfloat16"
    engine, _ = load_config(["device.device=cpu", "device.num_threads=1", "model.dtype=float32"])
    assert engine.model.dtype == "float32"
