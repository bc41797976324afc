"""`servelab-serve`: the workbench's front door to the engine's HTTP server.

    servelab-serve [--host H] [--port P] [--api-key K] [--served-model-name N] [hydra overrides...]
    servelab-serve model=llama-3-8b model.num_layers_override=2 scheduler.max_num_seqs=8 server.port=8001

Hydra composes conf/serve.yaml (the same model / scheduler / cache / attention / device groups
as servelab-run, plus `server:`) into the typed `ServeConfig`; `--flag value` options are
`server.flag=value` overrides. An unknown key or group option stops start-up with one line.
The server itself is `engine.entrypoints.serve`, which needs no `conf/`: the harness's server
target starts it directly with a config file (see docs/serving.md).
"""

from __future__ import annotations

import sys
import tempfile

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerSettings
from engine.entrypoints.serve import ConfigError, flags_to_overrides, run, serving_defaults


def load_config(overrides: list[str]) -> tuple[EngineConfig, ServerSettings]:
    """Compose conf/serve.yaml with `overrides`; ConfigError (one line) on anything unknown."""
    from conf.schema import ServeConfig, compose_typed

    try:
        cfg: ServeConfig = compose_typed(ServeConfig, "serve", overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        engine = cfg.engine_config(shape_dir=tempfile.mkdtemp(prefix="servelab-shape-") if cfg.model.arch else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    serving_defaults(engine, {item.split("=", 1)[0].lstrip("+~") for item in overrides}, cfg.model.dtype)
    return engine, cfg.server


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        print("see docs/serving.md for every option")
        return
    try:
        overrides = flags_to_overrides(args)
        if "--config" in overrides:
            raise ConfigError("--config is the engine entry's option: python -m engine.entrypoints.serve --config FILE")
        engine_config, settings = load_config(overrides)
    except ConfigError as exc:
        raise SystemExit(f"servelab-serve: {exc}") from None
    run(engine_config, settings)


if __name__ == "__main__":
    main()
