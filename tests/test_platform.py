"""dtype="auto" resolution (engine/platform.py): CPU flags / GEMM probe on a CPU, checkpoint dtype on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import platform
from engine.config import EngineConfig
from engine.kernels import isa

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Forget the cached CPU decision; returns a setter for the CPU flags seen."""
    isa.fastest_cpu_dtype.cache_clear()
    monkeypatch.setattr(platform, "_logged", set())
    yield lambda flags: monkeypatch.setattr(isa, "cpu_flags", lambda: set(flags))
    isa.fastest_cpu_dtype.cache_clear()


def test_concrete_dtypes_pass_through_and_bad_names_fail() -> None:
    for name in platform.DTYPE_NAMES:
        assert platform.resolve_dtype(name, CPU) == name
    with pytest.raises(ValueError, match="dtype: must be auto or one of"):
        platform.resolve_dtype("int8", CPU)


def test_cpu_auto_follows_the_amx_flag(fresh, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa, "_gemm_speedup", lambda: pytest.fail("AMX decides without a probe"))
    fresh({"avx512f", "avx512_bf16", "amx_bf16"})
    with caplog.at_level("INFO", logger="engine.platform"):
        assert platform.resolve_dtype("auto", CPU) == "bfloat16"
        assert platform.resolve_dtype("auto", CPU) == "bfloat16"
    assert [r.getMessage() for r in caplog.records] == ["dtype auto -> bfloat16 (amx_bf16)"]  # logged once
    isa.fastest_cpu_dtype.cache_clear()
    fresh({"avx512f", "avx2"})
    assert platform.resolve_dtype("auto", CPU) == "float32"


@pytest.mark.parametrize(("speedup", "expected"), [(2.1, "bfloat16"), (0.6, "float32")])  # a Zen 5; a Xeon, AMX hidden
def test_cpu_auto_with_avx512_bf16_alone_runs_a_gemm_probe(fresh, monkeypatch, speedup, expected) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    fresh({"avx512f", "avx512_bf16"})
    monkeypatch.setattr(isa, "_gemm_speedup", lambda: speedup)
    name, why = isa.fastest_cpu_dtype()
    assert name == expected and why == f"avx512_bf16, no AMX: GEMM probe: bfloat16 {speedup:.2f}x float32"


def test_cpu_auto_without_flags_runs_a_gemm_probe(fresh, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fresh(set())
    monkeypatch.setattr(isa, "_gemm_speedup", lambda: 2.0)
    name, why = isa.fastest_cpu_dtype()
    assert name == "bfloat16" and why == "GEMM probe: bfloat16 2.00x float32"


def test_gemm_probe_measures_what_this_cpu_multiplies_natively() -> None:
    """bfloat16 against float32 at the probe's shape: positive and finite everywhere; below 1 on a
    CPU that multiplies bfloat16 natively neither way (emulated: 0.014x on a 2-core AMD EPYC with
    AVX2 only), where `fastest_cpu_dtype` then picks float32 without probing."""
    speedup = isa._gemm_speedup(rounds=1)
    assert 0 < speedup < 50
    if not set(isa.BF16_CPU_FLAGS) & isa.cpu_flags() and isa.cpu_flags():
        assert speedup < 1
        assert isa.fastest_cpu_dtype()[0] == "float32"


def test_gpu_auto_is_the_checkpoint_dtype(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert platform.resolve_dtype("auto", GPU, "hf", tmp_path) == "float16"
    assert platform.resolve_dtype("auto", GPU, "gguf", tmp_path / "m.gguf") == "bfloat16"  # Q4_1 GGUF
    assert platform.resolve_dtype("auto", GPU, "conf") == "bfloat16"


def test_engine_config_resolves_auto_once_validated() -> None:
    cfg = EngineConfig.from_kwargs("smollm2", device="cpu")
    assert cfg.model.dtype == isa.fastest_cpu_dtype()[0]
    assert EngineConfig.from_kwargs("smollm2", dtype="float32").model.dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be auto"):
        EngineConfig.from_kwargs("smollm2", dtype="fp64")



def test_interleaved_timer_takes_turns_and_keeps_each_best() -> None:
    calls: list[str] = []
    best = isa.best_seconds_interleaved([lambda: calls.append("a"), lambda: calls.append("b")], rounds=3)
    assert calls == ["a", "b"] * 4  # one warm-up call each, then three rounds in turn
    assert len(best) == 2 and all(0 <= t < 1 for t in best)
