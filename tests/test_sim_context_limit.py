"""The simulated executor's context length follows the real engines' rule (issue 60 item 3).

It used to hand the scheduler the model's context and let it take min(max_model_len, KV
capacity) without a word: a plan on too small a cache dropped its long requests quietly. Now,
as the real workers do (engine/context_length.py): a `model.max_model_len` the KV cache cannot
hold stops start-up with one line naming both numbers and the setting that sized the cache; an
unset one is lowered to the cache with a warning naming both; one that fits is left alone.
"""

from __future__ import annotations

import logging

import pytest

from engine.config import ConfigLimitError, EngineConfig
from engine.core.engine_core import EngineCore
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from engine.sim.hardware import HardwareProfile
from engine.sim.model_counts import load_arch

ARCH = ModelArch(8, 2, 4, 2, 2, 16, vocab_size=64, eos_token_id=8, max_position_embeddings=4096)


def _core(max_model_len: int | None, num_blocks: int | None = 16, **kwargs: object) -> EngineCore:
    cfg = EngineConfig()
    cfg.cache.num_blocks, cfg.cache.block_size = num_blocks, 16
    cfg.model.max_model_len = max_model_len
    executor = SimulatedExecutor(cfg, CalibratedStepModel(0.001, {}), ARCH, **kwargs)  # type: ignore[arg-type]
    return EngineCore(cfg, executor)


def test_a_max_model_len_the_cache_cannot_hold_is_refused_naming_both() -> None:
    with pytest.raises(ConfigLimitError) as err:
        _core(max_model_len=1024)  # the cache holds 16 x 16 = 256 tokens
    msg = str(err.value)
    assert "model.max_model_len=1024" in msg and "256 tokens" in msg and "cache.num_blocks=16" in msg, msg


def test_an_unset_max_model_len_is_lowered_to_the_cache_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        core = _core(max_model_len=None)
    assert core.max_model_len == 256 and core.executor.max_model_len == 256 and core.scheduler.max_model_len == 256
    warned = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert any("4096" in m and "256" in m for m in warned), warned


def test_a_max_model_len_that_fits_is_kept() -> None:
    core = _core(max_model_len=200)
    assert core.max_model_len == 200 and core.scheduler.max_model_len == 200


def test_a_cache_sized_by_the_hardware_names_the_simulated_setting() -> None:
    hw = HardwareProfile.load("h100")
    arch = load_arch("llama-3.1-8b")  # 131072 positions; 0.3 x 80 GB less 16 GB of weights holds fewer

    def executor(max_model_len: int | None) -> SimulatedExecutor:
        cfg = EngineConfig()
        cfg.model.max_model_len = max_model_len
        return SimulatedExecutor(cfg, CalibratedStepModel(0.001, {}), arch, hardware=hw, gpu_memory_utilization=0.3)

    unset = executor(None)
    holds = unset.initialize() * unset.config.cache.block_size
    assert unset.max_model_len == holds < 131072
    refused = executor(131072)
    with pytest.raises(ConfigLimitError) as err:
        EngineCore(refused.config, refused)
    msg = str(err.value)
    assert "model.max_model_len=131072" in msg and f"{holds} tokens" in msg and "gpu_memory_utilization=0.3" in msg, msg
