"""`servelab-run`: one experiment, or a sweep with `-m` / `sweep=<name>`.

    servelab-run                                   # the default experiment
    servelab-run workload=shared_prefix scheduler.max_num_batched_tokens=512
    servelab-run -m scheduler.max_num_batched_tokens=256,1024 cache.enable_prefix_caching=true,false
    servelab-run sweep=budgets_prefix

Each job writes a run folder and prints its report path; a sweep also writes
`sweep.csv` (one row per job) and a sweep report in the sweep folder. Hydra's composed
config becomes the typed `conf.schema.RunConfig`; an unknown key or group option stops
start-up with one line.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from conf.schema import RunConfig, check_overrides, compose_typed, register_schemas

register_schemas()
_FAILED: list[str] = []  # run folders whose experiment failed (Hydra drops the task's return value)
_DONE: list[str] = []  # run folders that finished, for run.history
HISTORY_KEY = "run.history="  # `run.history=URL`: record each finished run in that store (docs/history.md)


@hydra.main(version_base=None, config_path="pkg://conf", config_name="run")
def _main(cfg: DictConfig) -> int:
    from workloads.experiment import run_experiment
    from workloads.sweep import saturated_below, write_job_overrides

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    write_job_overrides(run_dir, list(hc.overrides.task))
    skip = saturated_below(run_dir, list(hc.overrides.task)) if hc.mode == RunMode.MULTIRUN else None
    if skip:  # a rate sweep stops climbing past its first saturated rate
        Path(run_dir, "error.txt").write_text(skip + "\n")
        print(f"servelab-run: {skip}")
        return 0
    run_cfg = OmegaConf.to_object(cfg)
    assert isinstance(run_cfg, RunConfig)
    outcome = run_experiment(run_cfg, run_dir)
    if outcome.error:
        print(f"servelab-run: {outcome.error}", file=sys.stderr)
    print(f"run folder: {outcome.run_dir}")
    if outcome.report is not None:
        print(f"report: {outcome.report}")
    if outcome.error:
        _FAILED.append(str(outcome.run_dir))
    else:
        _DONE.append(str(outcome.run_dir))
    return 1 if outcome.error else 0


# Hydra's own options that take a value (`--cfg job`, `-cn run`, ...): not overrides.
_VALUE_FLAGS = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c", "--cfg",
                "-p", "--package", "-i", "--info"}


def hydra_overrides(argv: list[str]) -> list[str]:
    """The `key=value` overrides among Hydra's command-line arguments."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            if "=" not in arg:
                continue
        if arg.startswith("-"):
            skip = arg in _VALUE_FLAGS
            continue
        out.append(arg)
    return out


def flags_first(argv: list[str]) -> list[str]:
    """Hydra's flags (with their values) before the overrides: argparse takes the overrides as one
    positional list, so `target=openai --cfg job x=1` would leave `x=1` unrecognised."""
    overrides = hydra_overrides(argv)
    flags, rest = [], list(overrides)
    for arg in argv:
        if rest and arg == rest[0]:
            rest.pop(0)
        else:
            flags.append(arg)
    return [*flags, *overrides]


def precheck(argv: list[str]) -> str | None:
    """Why this command line cannot compose (one line), or None.

    Unknown keys and group options are named first (`check_overrides`). A single run is then
    composed once and typed, so an unknown key in a yaml file or a value of the wrong type is
    also one line rather than Hydra's multi-line report; a sweep (`-m`) is left to Hydra.
    """
    overrides = hydra_overrides(argv)
    if "-m" in argv or "--multirun" in argv:
        return check_overrides(RunConfig, overrides)
    try:
        compose_typed(RunConfig, "run", [o for o in overrides if not o.startswith("hydra")])
    except ValueError as exc:
        return str(exc)
    return None


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Hydra's own logging stays out of the way unless the user asks for it.
    history = [a[len(HISTORY_KEY):] for a in sys.argv[1:] if a.startswith(HISTORY_KEY)]
    argv = [a for a in sys.argv[1:] if not a.startswith(HISTORY_KEY)]  # not a config key: kept out of Hydra
    problem = precheck(argv)
    if problem:
        print(f"servelab-run: {problem}", file=sys.stderr)
        sys.exit(2)
    quiet = ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if any(a.startswith("hydra/job_logging") or a.startswith("hydra/hydra_logging") for a in argv):
        quiet = []
    sys.argv = [sys.argv[0], *flags_first(argv), *quiet]
    _main()
    if history and _DONE:
        from history.cli import record_after_run

        record_after_run(history[-1], _DONE)
    if _FAILED:
        sys.exit(1)


if __name__ == "__main__":
    main()
