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
    with pytest.raises(ValueError, match="above the context of llama-3-8b"):  # never silently capped
        arch.max_model_len(100_000)
    assert arch.max_model_len(100_000, allow_long=True) == 100_000  # model.allow_long_max_model_len


def test_one_dtype_map() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("bf16") is torch.bfloat16
    assert canonical_dtype("float16") == "fp16" and canonical_dtype("fp8_e4m3") == "fp8"
    with pytest.raises(ValueError, match="dtype: must be one of float32, bfloat16, float16"):
        torch_dtype("int8")
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        canonical_dtype("int4")


# ---- the workbench's typed configs and the engine's serve config file ------------------
def test_run_config_is_typed_and_its_engine_part_is_the_engine_config(tmp_path) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from conf.schema import ModelSection, RunConfig, register_schemas
    from engine.model.loader import resolve_model

    register_schemas()
    arch = "{hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 48, vocab_size: 64}"
    with initialize_config_module(config_module="conf", version_base=None):
        composed = compose(config_name="run", overrides=["experiment=ci_gate", "model.model=tiny",
                                                         f"model.arch={arch}"])  # fmt: skip
    cfg = OmegaConf.to_object(composed)
    assert isinstance(cfg, RunConfig) and isinstance(cfg, EngineConfig) and isinstance(cfg.model, ModelSection)
    assert cfg.cache.num_blocks == 24 and cfg.scheduler.max_num_seqs == 8  # the experiment's values
    engine = cfg.engine_config(shape_dir=tmp_path)
    assert type(engine) is EngineConfig and engine.scheduler is cfg.scheduler
    assert engine.model.model == str(tmp_path / "tiny.yaml")  # the shape defined in the config
    arch_loaded, weights, _ = resolve_model(engine.model)
    assert weights is None and (arch_loaded.hidden_size, arch_loaded.num_layers) == (32, 2)


def test_check_overrides_names_unknown_keys_in_one_line() -> None:
    from conf.schema import PlanConfig, RunConfig, ServeConfig, check_overrides

    ok = ["scheduler.max_num_seqs=4", "model.arch.hidden_size=8", "hydra.run.dir=x", "attention=torch,triton"]
    assert check_overrides(RunConfig, ok) is None
    assert check_overrides(RunConfig, ["workload.prompt_len.valu=3"]) == (
        "unknown key 'workload.prompt_len.valu': workload.prompt_len (LengthSection) has dist, value, low, high, "
        "mean, std, path, column, min_len, max_len")
    assert "unknown key 'server.port'" in (check_overrides(RunConfig, ["server.port=1"]) or "")
    assert check_overrides(ServeConfig, ["server.port=1"]) is None
    assert check_overrides(PlanConfig, ["plan.rates=[1,2]"]) is None
    assert check_overrides(RunConfig, ["target=servr"]) == (
        "unknown target 'servr' (known: inprocess, llamacpp, offline, openai, pd, server, simulated, vllm)")


def test_engine_serve_reads_one_config_file_strictly(tmp_path) -> None:
    from engine.entrypoints.serve import ConfigError, load_config

    path = tmp_path / "serve.yaml"
    path.write_text("model: {model: llama-3-8b, num_layers_override: 2}\nscheduler: {max_num_seqs: 8}\n"
                    "server: {api_key: k, port: 8001}\n")  # fmt: skip
    engine, settings = load_config(["--config", str(path), "scheduler.max_num_seqs=4", "--port", "9000"])
    assert (engine.model.model, engine.model.num_layers_override, engine.scheduler.max_num_seqs) == (
        "llama-3-8b", 2, 4)
    assert (settings.api_key, settings.port) == ("k", 9000)  # flags win over the file
    engine, _ = load_config(["model=mixtral-8x7b", "model.max_model_len=null", "attention=triton"])
    assert engine.model.model == "mixtral-8x7b" and engine.model.max_model_len is None
    assert engine.attention.backend == "triton"
    for args, message in [
        (["scheduler.max_num_seq=4"], "unknown key 'scheduler.max_num_seq'"),
        (["server.prot=1"], "unknown key 'server.prot'"),
        (["--prot", "1"], "unknown option --prot"),
        (["--config", str(tmp_path / "none.yaml")], "--config: cannot read"),
        (["scheduler=default"], "expected section.key=value"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(args)


def test_servelab_run_precheck_is_one_line() -> None:
    from workloads.cli import precheck

    assert precheck(["experiment=ci_gate", "hydra.run.dir=/tmp/x", "--cfg", "job"]) is None
    assert precheck(["-m", "attention=torch,triton"]) is None  # a sweep is Hydra's to expand
    assert precheck(["workload.num_requests=abc"]) == (
        "Error merging override workload.num_requests=abc; Value 'abc' of type 'str' could not be converted "
        "to Integer")
    assert precheck(["workload.prompt_len={dist: fixed, valu: 3}"]) == (
        "Could not override 'workload.prompt_len'.; Key 'valu' not in 'LengthSection'")
    assert precheck(["scheduler.max_num_seq=3"]).startswith("unknown key 'scheduler.max_num_seq'")  # type: ignore[union-attr]


def test_every_model_choice_names_a_model_the_engine_has() -> None:
    """`make bench model=NAME` / `servelab-run model=NAME` for every conf/model/NAME.yaml: its model is the
    embedded default, a packaged real model (CHUNKED_MODELS) or a packaged shape (engine/model/shapes)."""
    from pathlib import Path

    import yaml

    from engine.model import source

    conf_dir = Path(__file__).resolve().parents[1] / "conf" / "model"
    known = set(source.EMBEDDED_NAMES) | set(source.CHUNKED_MODELS) | {p.stem for p in source.SHAPES_DIR.glob("*.yaml")}
    choices = {path.stem: yaml.safe_load(path.read_text())["model"] for path in conf_dir.glob("*.yaml")}
    assert {"smollm2", "gemma3-270m", "qwen3-8b", "gemma-3-27b"} <= set(choices)
    unknown = {stem: name for stem, name in choices.items() if name not in known}
    assert not unknown, f"conf/model choices naming no model the engine has: {unknown}"
    assert all(stem == name for stem, name in choices.items()), choices
