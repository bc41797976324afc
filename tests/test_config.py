"""Engine configuration: vLLM's engine-argument names, strict section loading, the shared rules."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.dtypes import canonical_dtype, torch_dtype
from engine.sim.model_counts import load_arch


def test_vllm_engine_argument_names() -> None:
    cfg = EngineConfig.from_kwargs(
        "smollm2", num_gpu_blocks_override=24, dtype="bfloat16", seed=3, enforce_eager=False, max_model_len=128,
        enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
    )  # fmt: skip
    assert (cfg.cache.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching) == (24, 8, False)
    assert (cfg.model.dtype, cfg.model.seed, cfg.model.enforce_eager, cfg.model.max_model_len) == (
        "bfloat16", 3, False, 128)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (4, 64)
    assert EngineConfig.from_kwargs(num_blocks=24).cache.num_blocks == 24  # the old name stays
    assert EngineConfig.from_kwargs(attention_backend="triton").attention.backend == "triton"
    with pytest.raises(ValueError, match="unknown engine argument 'gpu_blocks'"):
        EngineConfig.from_kwargs(gpu_blocks=3)


def test_from_sections_is_strict() -> None:
    cfg = EngineConfig.from_sections({"scheduler": {"max_num_seqs": 8}, "model": {"model": "llama-3-8b"}})
    assert cfg.scheduler.max_num_seqs == 8 and cfg.model.model == "llama-3-8b"
    assert cfg.scheduler.max_num_batched_tokens == EngineConfig().scheduler.max_num_batched_tokens
    with pytest.raises(ValueError, match=r"unknown key 'scheduler.max_num_seq' \(known: max_num_batched_tokens"):
        EngineConfig.from_sections({"scheduler": {"max_num_seq": 8}})
    with pytest.raises(ValueError, match="unknown engine config section 'schedular'"):
        EngineConfig.from_sections({"schedular": {}})


def test_one_max_model_len_rule() -> None:
    arch = load_arch("llama-3-8b")  # 8192 positions
    assert arch.max_model_len(None) == 8192
    assert arch.max_model_len(1024) == 1024
    assert arch.max_model_len(100_000) == 8192  # never above what the model was trained for


def test_one_dtype_map() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("bf16") is torch.bfloat16
    assert canonical_dtype("float16") == "fp16" and canonical_dtype("fp8_e4m3") == "fp8"
    with pytest.raises(ValueError, match="dtype: must be one of float32, bfloat16, float16"):
        torch_dtype("int8")
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        canonical_dtype("int4")
