"""`servelab-run`: one experiment, or a sweep with `-m` / `sweep=<name>`.

    servelab-run                                   # the default experiment
    servelab-run workload=shared_prefix scheduler.max_num_batched_tokens=512
    servelab-run -m scheduler.max_num_batched_tokens=256,1024 cache.enable_prefix_caching=true,false
    servelab-run sweep=budgets_prefix

Each job writes a run folder and prints its report path; a sweep also writes
`sweep.csv` (one row per job) and a sweep report in the sweep folder.
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from conf.schema import register_schemas

register_schemas()
_FAILED: list[str] = []  # run folders whose experiment failed (Hydra drops the task's return value)


@hydra.main(version_base=None, config_path="pkg://conf", config_name="run")
def _main(cfg: DictConfig) -> int:
    from workloads.experiment import run_experiment
    from workloads.sweep import write_job_overrides

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    write_job_overrides(run_dir, list(hc.overrides.task))
    outcome = run_experiment(cfg, run_dir)
    if outcome.error:
        print(f"servelab-run: {outcome.error}", file=sys.stderr)
    print(f"run folder: {outcome.run_dir}")
    if outcome.report is not None:
        print(f"report: {outcome.report}")
    if outcome.error:
        _FAILED.append(str(outcome.run_dir))
    return 1 if outcome.error else 0


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Hydra's own logging stays out of the way unless the user asks for it.
    argv = sys.argv[1:]
    quiet = ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith("hydra/job_logging") or a.startswith("hydra/hydra_logging") for a in argv):
        sys.argv = [sys.argv[0], *argv, *quiet]
    _main()
    if _FAILED:
        sys.exit(1)


if __name__ == "__main__":
    main()
