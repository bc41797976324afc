"""The engine's serve entry: start the EngineCore and the OpenAI-compatible HTTP server.

    python -m engine.entrypoints.serve [--config FILE] [--port P] [--api-key K] [section.key=value ...]
    python -m engine.entrypoints.serve --config run/serve_config.yaml --port 8001
    python -m engine.entrypoints.serve model=llama-3-8b model.num_layers_override=2 server.port=8001

Needs nothing outside `engine/` (no Hydra, no `conf/`). The configuration is one YAML file
(`--config`) with the sections `model`, `cache`, `scheduler`, `attention`, `device` (the
fields of `engine.config`) and `server` (`ServerSettings`), then `section.key=value`
overrides (values read as YAML; `model=X` is short for `model.model=X`, `attention=X` for
`attention.backend=X`), then `--flag value`
options for the server section (`--port 8001` = `server.port=8001`). An unknown section,
key or option stops start-up with one line naming it. `servelab-serve` (workloads/serve.py)
is the workbench's front door to the same server: it composes conf/serve.yaml with Hydra.
SIGTERM and SIGINT shut down cleanly: stop accepting, end in-flight streams, stop the engine
process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Collection
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerSettings, build_app

logger = logging.getLogger("servelab.serve")

_FLAG_KEYS = {f.name for f in fields(ServerSettings)}
_SHORTHANDS = {"model": "model.model", "attention": "attention.backend"}


class ConfigError(ValueError):
    """A configuration the server cannot start with; its message is one line for the user."""


def flags_to_overrides(argv: list[str]) -> list[str]:
    """`--api-key k`, `--port=8001`, `--multiprocess` -> `server.api_key=k`, ... ; others pass through.

    `--config FILE` passes through unchanged (as the pair `--config`, `FILE`).
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            out.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key == "config":
            if not eq:
                if i >= len(argv):
                    raise ConfigError("--config needs a file")
                value, i = argv[i], i + 1
            out += ["--config", value]
            continue
        if key not in _FLAG_KEYS:
            raise ConfigError(f"unknown option --{name} (known: --config, "
                              f"{', '.join('--' + k.replace('_', '-') for k in sorted(_FLAG_KEYS))})")  # fmt: skip
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                value = argv[i]
                i += 1
            else:
                value = "true"
        out.append(f"server.{key}={value}")
    return out


def load_config(args: list[str]) -> tuple[EngineConfig, ServerSettings]:
    """The engine and server configs from `--config FILE`, `section.key=value` and `--flag`
    arguments (in that order of precedence, lowest first); ConfigError names what is wrong."""
    args = flags_to_overrides(args)
    data: dict[str, Any] = {}
    overrides: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--config":
            data = read_config_file(Path(args[i + 1]))
            i += 2
            continue
        overrides.append(args[i])
        i += 1
    for item in overrides:
        apply_override(data, item)
    server = data.pop("server", None) or {}
    try:
        engine = EngineConfig.from_sections(data)
        settings = _server_settings(server)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    serving_defaults(engine, {f"{section}.{key}" for section, values in data.items() for key in (values or {})},
                     str((data.get("model") or {}).get("dtype", "auto")))
    return engine, settings


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {str(path)!r} is not valid YAML ({type(exc).__name__})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict | None) for v in data.values()):
        raise ConfigError(f"--config: {str(path)!r} must map section names to mappings of keys")
    return {k: dict(v or {}) for k, v in data.items()}


def apply_override(data: dict[str, Any], item: str) -> None:
    """`section.key=value` (value read as YAML) into `data`; `model=X` and `attention=X` are short
    for `model.model=X` and `attention.backend=X` (what servelab-serve's groups of those names set)."""
    dotted, eq, text = item.partition("=")
    if not eq:
        raise ConfigError(f"expected section.key=value, got {item!r}")
    dotted = _SHORTHANDS.get(dotted, dotted)
    section, dot, key = dotted.partition(".")
    if not dot or not key or "." in key:
        raise ConfigError(f"expected section.key=value (e.g. scheduler.max_num_seqs=8), got {item!r}")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    if section == "model" and key == "model":
        value = text  # a model name or path stays a string ("1.5b" is not a number)
    data.setdefault(section, {})[key] = value


def _server_settings(values: dict[str, Any]) -> ServerSettings:
    known = [f.name for f in fields(ServerSettings)]
    for key in values:
        if key not in known:
            raise ValueError(f"unknown key 'server.{key}' (known: {', '.join(known)})")
    return ServerSettings(**values)


# servelab-serve's token budget per step on a CPU, where none is given (see serving_defaults).
CPU_SERVING_BATCHED_TOKENS = 512


def serving_defaults(engine: EngineConfig, explicit: Collection[str] = (), requested_dtype: str = "auto") -> None:
    """The defaults a server gets that offline use does not; `explicit` names the settings the
    user gave (`section.key`, or a whole `section` group), which are never changed;
    `requested_dtype` is the `model.dtype` the config asked for, before `auto` was resolved.

    - `model.warm_up_linears` on: no step of a live server waits for oneDNN to build a kernel.
    - On a CPU, `scheduler.max_num_batched_tokens` 512 instead of 2,048. A step of 2,048 prompt
      tokens takes ~0.3 s on a 2-core CPU: every prompt of a burst waits for all of it, and every
      running stream stalls as long. At 512 the first prompts of a burst start streaming after
      ~80 ms. Measured with benchmarks/serving_throughput.py (16 concurrent streams of 128 + 128
      tokens, 2-core AMX CPU): TTFT p50 367 -> 232 ms, TPOT p50 24.5 -> 26.1 ms, output 584 ->
      559 tok/s. The offline `LLM` keeps 2,048 (throughput first).
    - On a CPU, `model.dtype` auto resolves for serving (`engine/kernels/isa.py`, `serving_cpu_dtype`):
      bfloat16 wherever the CPU has avx512_bf16 or AMX, where offline use may pick float32 for
      its compute-bound batches (an Intel Xeon whose AMX a KVM guest hides: 16 streams 251.5
      against 168-184 output tok/s in float32). A dtype the user gives, or that a config file
      names (the workbench's server target hands its run's resolved dtype so), is kept.
    - On a CPU, the EngineCore computes on every core available (unless told otherwise).
      The API process (HTTP, detokenizing, SSE) spends ~0.2-0.3 ms of CPU per output token
      against ~12 ms in the engine (same benchmark), so reserving it a core (the old rule, all
      cores but one: one model thread on a 2-core machine) idled half the machine's compute to
      save ~2%. An OMP_NUM_THREADS in the environment is respected (torch's own default then
      applies): on a machine shared with other busy processes, fewer threads can be faster.
    """
    from engine.platform import resolve_device

    if engine.model.warm_up_linears is None:
        engine.model.warm_up_linears = True
    if resolve_device(engine.device.device, check=False).type == "cuda":
        return
    if requested_dtype == "auto" and "model.dtype" not in explicit:  # auto, resolved for serving
        from engine.kernels.isa import serving_cpu_dtype

        name, why = serving_cpu_dtype()
        if name != engine.model.dtype:
            logger.info("model.dtype=%s (servelab-serve's CPU default for dtype auto: %s)", name, why)
            engine.model.dtype = name
    if not {"scheduler", "scheduler.max_num_batched_tokens"} & set(explicit):
        engine.scheduler.max_num_batched_tokens = CPU_SERVING_BATCHED_TOKENS
        logger.info("scheduler.max_num_batched_tokens=%d (servelab-serve's CPU default)", CPU_SERVING_BATCHED_TOKENS)
    if engine.device.num_threads > 0 or os.environ.get("OMP_NUM_THREADS"):
        return
    engine.device.num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    logger.info("EngineCore on %d CPU threads (device.num_threads=0: every core)", engine.device.num_threads)


async def serve(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Run until SIGTERM/SIGINT, or until the engine dies and the server is told to stop."""
    from engine.entrypoints.memtrace import MemoryTracer
    from engine.frontend.async_llm import AsyncLLM

    tracer = None
    if settings.tracemalloc_dir:  # before the model loads: a folder it cannot write stops start-up at once
        try:
            tracer = MemoryTracer(settings.tracemalloc_dir)
        except ValueError as exc:
            raise SystemExit(f"servelab-serve: {exc}") from None
    llm = AsyncLLM.from_config(engine_config, multiprocess=settings.multiprocess,
                               ready_timeout_s=settings.ready_timeout_s)
    model_name = settings.served_model_name or engine_config.model.model
    app = build_app(llm, settings, model_name)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=logger if settings.log_requests else None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        logger.info("serving %s on http://%s:%d", model_name, settings.host, settings.port)
        if tracer is not None:
            tracer.start()
        await stop.wait()
        logger.info("shutting down")
    finally:
        llm.shutdown()  # in-flight streams end with an error event first
        await runner.cleanup()
        if tracer is not None:
            tracer.close()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        print("options: --config " + " ".join(f"--{k.replace('_', '-')}" for k in sorted(_FLAG_KEYS)))
        print("see docs/serving.md for every option")
        return
    try:
        engine_config, settings = load_config(args)
    except ConfigError as exc:
        raise SystemExit(f"servelab-serve: {exc}") from None
    run(engine_config, settings)


def run(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Log to stderr and serve until told to stop (both front doors end here)."""
    from engine.core.core_client import EngineStartError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(engine_config, settings))
    except EngineStartError as exc:  # its message is the core's own reason (e.g. a limit to change)
        raise SystemExit(f"servelab-serve: {exc}") from None


if __name__ == "__main__":
    main()
