"""`servelab-serve`: start the EngineCore and the OpenAI-compatible HTTP server.

    servelab-serve [--host H] [--port P] [--api-key K] [--served-model-name N] [hydra overrides...]
    servelab-serve model=smollm2 scheduler.max_num_seqs=8 server.port=8001

The config is conf/serve.yaml (model / scheduler / cache / attention / device groups plus
`server:`); `--flag value` style options are translated to `server.flag=value`
overrides before Hydra composes. SIGTERM and SIGINT shut down cleanly: stop accepting,
end in-flight streams, stop the engine process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import fields
from typing import Any

from aiohttp import web

from engine.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.entrypoints.api_server import ServerSettings, build_app

logger = logging.getLogger("servelab.serve")

_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "attention": AttentionConfig,
    "device": DeviceConfig,
}
_FLAG_KEYS = {f.name for f in fields(ServerSettings)}


def flags_to_overrides(argv: list[str]) -> list[str]:
    """`--api-key k`, `--port=8001`, `--multiprocess` -> `server.api_key=k`, ... ; others pass through."""
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
        if key not in _FLAG_KEYS:
            raise SystemExit(f"servelab-serve: unknown option --{name} (known: {sorted(_FLAG_KEYS)})")
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                value = argv[i]
                i += 1
            else:
                value = "true"
        out.append(f"server.{key}={value}")
    return out


def load_config(overrides: list[str]) -> tuple[EngineConfig, ServerSettings]:
    """Compose conf/serve.yaml with Hydra and split it into the engine and server configs."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="serve", overrides=overrides)
    data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    engine = EngineConfig(**{name: _build(cls, data.get(name) or {}) for name, cls in _SECTIONS.items()})
    engine.validate()
    settings = _build(ServerSettings, data.get("server") or {})
    engine_threads(engine)
    return engine, settings


def engine_threads(engine: EngineConfig) -> None:
    """On a CPU, the EngineCore process computes on every core available (unless told otherwise).

    Measured with benchmarks/serving_throughput.py (64 requests x 128 + 128 tokens at
    concurrency 16): the API process (HTTP, detokenizing, SSE) spends ~0.2-0.3 ms of CPU per
    output token against ~12 ms in the engine, so reserving it a core (the old rule, all cores
    but one: one model thread on a 2-core machine) idled half the machine's compute to save ~2%.
    Its short wake-ups between steps now preempt a model thread for a few ms per step instead.
    An OMP_NUM_THREADS in the environment is respected (torch's own default then applies): on a
    machine shared with other busy processes, fewer threads than cores can be faster.
    """
    import torch

    on_gpu = engine.device.device == "cuda" or (engine.device.device == "auto" and torch.cuda.is_available())
    if on_gpu or engine.device.num_threads > 0 or os.environ.get("OMP_NUM_THREADS"):
        return
    engine.device.num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    logger.info("EngineCore on %d CPU threads (device.num_threads=0: every core)", engine.device.num_threads)


def _build(cls: type, values: dict[str, Any]) -> Any:
    """Dataclass from the keys it knows (group files may carry extra keys, e.g. model.arch)."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


async def serve(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Run until SIGTERM/SIGINT, or until the engine dies and the server is told to stop."""
    from engine.async_llm import AsyncLLM

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
        await stop.wait()
        logger.info("shutting down")
    finally:
        llm.shutdown()  # in-flight streams end with an error event first
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        print("options: " + " ".join(f"--{k.replace('_', '-')}" for k in sorted(_FLAG_KEYS)))
        print("see docs/serving.md for every option")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = flags_to_overrides(args)
    engine_config, settings = load_config(overrides)
    asyncio.run(serve(engine_config, settings))


if __name__ == "__main__":
    main()
