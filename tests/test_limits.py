"""Context limits are start-up errors, never silent caps (issue 36, item 2).

A `model.max_model_len` above the model's context, or above what the KV cache holds, stops the
engine before it serves, naming both numbers and the setting to change; the opt-in
`model.allow_long_max_model_len` runs past the model's context (the RoPE table grows with it).
Tiny dummy shapes keep every engine here to a second or two.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.config import ConfigLimitError, EngineConfig
from engine.sampling_params import SamplingParams
from engine.sim.model_counts import load_arch

ROOT = Path(__file__).resolve().parents[1]

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 48, "vocab_size": 64, "max_position_embeddings": 256}  # fmt: skip


def tiny_shape(tmp_path: Path, **extra: object) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, **extra}))
    return str(path)


def tiny_llm(model: str, **kwargs: object):
    from engine.frontend.llm import LLM

    args = {"dtype": "float32", "block_size": 16, "max_num_seqs": 2, "max_num_batched_tokens": 128, **kwargs}
    return LLM(model=model, **args)


# ---- above the model's context --------------------------------------------------------
def test_max_model_len_above_the_models_context_is_refused() -> None:
    arch = load_arch("llama-3-8b")  # 8192 positions
    with pytest.raises(ConfigLimitError) as err:
        arch.max_model_len(131072)
    text = str(err.value)
    assert "131072" in text and "8192" in text and "model.allow_long_max_model_len" in text
    assert "\n" not in text
    assert arch.max_model_len(None) == 8192 and arch.max_model_len(1024) == 1024


def test_engine_start_refuses_a_context_above_the_models(tmp_path: Path) -> None:
    with pytest.raises(ConfigLimitError, match=r"max_model_len=512 .*256 tokens"):
        tiny_llm(tiny_shape(tmp_path), max_model_len=512, num_blocks=64)


def test_allow_long_max_model_len_runs_past_the_models_context(tmp_path: Path) -> None:
    llm = tiny_llm(tiny_shape(tmp_path), max_model_len=512, num_blocks=64, allow_long_max_model_len=True)
    assert llm.engine_core.max_model_len == 512
    assert llm.engine_core.executor.worker.model.model.rotary_emb.cos_table.shape[0] == 512
    prompt = {"prompt_token_ids": [3 + i % 50 for i in range(400)]}  # positions past the model's 256
    out = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


# ---- above what the KV cache holds ----------------------------------------------------
def test_max_model_len_above_the_kv_cache_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigLimitError) as err:
        tiny_llm(tiny_shape(tmp_path), max_model_len=128, num_blocks=4)  # 4 blocks of 16: 64 tokens
    text = str(err.value)
    assert "max_model_len=128" in text and "64 tokens" in text and "cache.num_blocks" in text


def test_unset_max_model_len_is_lowered_to_the_kv_cache_with_a_warning(tmp_path: Path, caplog) -> None:
    with caplog.at_level("WARNING", logger="engine.worker.worker"):
        llm = tiny_llm(tiny_shape(tmp_path), num_blocks=4)
    assert llm.engine_core.max_model_len == 64
    assert any("KV cache holds" in r.getMessage() for r in caplog.records)


def test_the_limit_reaches_an_in_process_front_end_as_its_reason(tmp_path: Path) -> None:
    """servelab-run's in-process target runs the core in a thread: its reason must not be lost."""
    from engine.core.core_client import EngineStartError
    from engine.frontend.async_llm import AsyncLLM

    cfg = EngineConfig.from_kwargs(tiny_shape(tmp_path), dtype="float32", max_model_len=128, num_blocks=4)
    with pytest.raises(EngineStartError, match=r"ConfigLimitError: model.max_model_len=128 .*64 tokens"):
        AsyncLLM.from_config(cfg, multiprocess=False, ready_timeout_s=60)


def test_servelab_serve_says_it_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"model": tiny_shape(tmp_path), "dtype": "float32", "max_model_len": 128},
        "cache": {"num_blocks": 4},
    }))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.serve", "--config", str(config), "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("servelab-serve: ") and "max_model_len=128" in last and "64 tokens" in last, proc.stderr
