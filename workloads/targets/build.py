"""The driven target kinds made from a run's config: one function a kind, each returning `Made`
(and `Ran`, what the kinds that run the experiment themselves return: offline.py, simulated.py).

Called through the registry (workloads/targets/registry.py), never by kind name. Each reads its
fields of the `target` section (conf/target/<kind>.yaml) and the engine's own sections; the
target classes are imported inside each function, so a run loads only its own kind's.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from conf.schema import RunConfig
from engine.config import EngineConfig
from engine.tokenizer import get_tokenizer


class Made(NamedTuple):
    """A driven kind, ready to start: the target the driver sends to, the tokenizer the workload
    is built with, and the longest sequence the target takes (prompt + output tokens)."""

    target: Any
    tokenizer: Any
    max_model_len: int


def make_inprocess(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Made:
    from workloads.targets.engine import EngineTarget

    target = EngineTarget(engine_config, hooks_factory=hooks_factory(cfg, run_dir))
    llm = target.load()
    return Made(target, llm.tokenizer, llm.max_model_len)


def make_server(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Made:
    from workloads.targets.engine import ServerTarget

    tokenizer = get_tokenizer(engine_config.model)
    target = ServerTarget(write_serve_config(engine_config, run_dir, cfg.target.server),
                          cfg.target.startup_timeout_s, str(run_dir / "server.log"),
                          endpoint=cfg.target.endpoint, timeout_s=cfg.target.request_timeout_s,
                          server_timing=cfg.target.server_timing)  # fmt: skip
    return Made(target, tokenizer, max_model_len(engine_config))


def make_pd(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Made:
    from workloads.targets.pd import PDTarget

    tokenizer = get_tokenizer(engine_config.model)
    t = cfg.target
    target = PDTarget(engine_config, run_dir, t.num_prefill, t.num_decode, t.router_policy, t.startup_timeout_s,
                      endpoint=t.endpoint, timeout_s=t.request_timeout_s, connector=t.kv_connector)  # fmt: skip
    return Made(target, tokenizer, max_model_len(engine_config))


def make_openai(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Made:
    from workloads.targets.openai import OpenAITarget

    tokenizer = get_tokenizer(engine_config.model)
    if not cfg.target.url:
        raise ValueError("target.url is required for target=openai")
    target = OpenAITarget(cfg.target.url, cfg.target.model_name or "", cfg.target.api_key,
                          cfg.target.endpoint, extra_body={"temperature": 0.0},
                          timeout_s=cfg.target.request_timeout_s, server_timing=cfg.target.server_timing)  # fmt: skip
    return Made(target, tokenizer, max_model_len(engine_config))


def make_vllm(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Made:
    from engine.platform import resolve_engine_dtype
    from workloads.targets.peer import VLLMTarget

    tokenizer = get_tokenizer(engine_config.model)
    t, sched = cfg.target, engine_config.scheduler
    target = VLLMTarget(t.venv, t.hf_model, max_num_seqs=sched.max_num_seqs,
                        max_num_batched_tokens=sched.max_num_batched_tokens,
                        max_model_len=max_model_len(engine_config),
                        dtype=resolve_engine_dtype(cfg.model.dtype, cfg.device.device, cfg.model.model),
                        extra_args=list(t.peer_args), extra_env=dict(t.peer_env),
                        startup_timeout_s=t.startup_timeout_s, log_path=str(run_dir / "server.log"),
                        endpoint=t.endpoint, timeout_s=t.request_timeout_s)  # fmt: skip
    return Made(target, tokenizer, max_model_len(engine_config))


def make_llamacpp(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Made:
    from engine.model.source import embedded_gguf_path
    from workloads.targets.peer import LlamaCppTarget

    tokenizer = get_tokenizer(engine_config.model)
    t = cfg.target
    gguf = t.gguf or str(embedded_gguf_path())
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    target = LlamaCppTarget(t.venv, gguf, max_model_len=max_model_len(engine_config),
                            threads=len(os.sched_getaffinity(0)),
                            eos_token_ids=eos, extra_args=list(t.peer_args), extra_env=dict(t.peer_env),
                            startup_timeout_s=t.startup_timeout_s, log_path=str(run_dir / "server.log"),
                            endpoint=t.endpoint, timeout_s=t.request_timeout_s)  # fmt: skip
    return Made(target, tokenizer, max_model_len(engine_config))


def max_model_len(engine_config: EngineConfig) -> int:
    """The model's context as the engine would take it (model.max_model_len, capped by the model)."""
    from engine.model.loader import resolve_model

    arch, _, _ = resolve_model(engine_config.model)
    return arch.max_model_len(engine_config.model.max_model_len, engine_config.model.allow_long_max_model_len)


def write_serve_config(engine_config: EngineConfig, run_dir: Path, server: dict[str, Any] | None = None) -> Path:
    """This run's engine config as the one file the server target hands `engine.entrypoints.serve`
    (`--config`); `server` (target.server) fills the server section, the target picks the port."""
    path = run_dir / "serve_config.yaml"
    data = asdict(engine_config)
    if server:
        data["server"] = {k: v for k, v in dict(server).items() if k not in ("host", "port")}
    path.write_text("# written by servelab-run for its server target (engine.entrypoints.serve --config)\n"
                    + yaml.safe_dump(data, sort_keys=False))  # fmt: skip
    return path


def hooks_factory(cfg: RunConfig, run_dir: Path):
    """The step profiler's hooks for an engine in this process (profiling.enabled), else None."""
    if not cfg.profiling.enabled:
        return None
    p = cfg.profiling

    def factory():
        from profiling.engine_hooks import StepProfilerHooks
        from profiling.torch_profiler import StepProfiler

        return StepProfilerHooks(StepProfiler(run_dir, wait=p.wait, warmup=p.warmup, active=p.active,
                                              repeat=p.repeat, record_shapes=p.record_shapes))

    return factory


class Ran(NamedTuple):
    """What a kind that runs the whole experiment itself (no driver) measured, for
    workloads/run_summary.py: the run, the time reference (None when not taken), the start-up
    compile seconds (None where none) and keys of its own for summary.json."""

    result: Any  # workloads.driver.RunResult
    reference: float | None
    compile_time_s: float | None = None
    summary: dict[str, Any] | None = None
