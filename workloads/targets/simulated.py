"""target=simulated: no model; the engine's own scheduler and KV-cache manager on a virtual clock,
step times from the `sim` section (a roofline or a calibrated model: engine/sim/). No driver: the
kind runs the experiment itself and returns what it measured (`Ran`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conf.schema import RunConfig
from engine.config import EngineConfig
from engine.tokenizer import get_tokenizer
from workloads.driver import RunResult
from workloads.factory import plan_workload
from workloads.send_schedule import send_limits
from workloads.targets.build import Ran


def run_simulated(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Ran:
    from engine.sim.executor import SimulatedExecutor
    from workloads.simulate import simulate

    s = cfg.sim
    tp, ep = cfg.sim_parallel()
    executor = SimulatedExecutor.from_names(engine_config, engine_config.model.model, s.hardware, tp=tp,
                                            step_model=s.step_model, dtype=s.dtype, token_id=int(s.token_id),
                                            gpu_memory_utilization=s.gpu_memory_utilization, ep=ep)
    tokenizer = get_tokenizer(engine_config.model)
    specs, extra = plan_workload(cfg, tokenizer, executor_max_len(executor, engine_config), run_dir)
    if extra:
        (run_dir / "workload_info.json").write_text(json.dumps(extra, indent=2, default=str))
    closed_loop, concurrency = send_limits(cfg)
    if not closed_loop and concurrency is not None:
        raise ValueError("workload.arrival.max_concurrency: the simulated target does not cap an open loop yet; "
                         "use a closed loop (workload.concurrency=N) or another target")
    res = simulate(specs, engine_config, executor, progress=True, closed_loop=closed_loop,
                   concurrency=concurrency, tokenize=tokenizer.encode, max_duration_s=cfg.run.max_duration_s)
    result = RunResult(records=res.records, t0_wall=0.0, wall_s=res.sim_s, steps=res.steps)
    return Ran(result, None, summary={"simulation_wall_s": res.wall_s})


def executor_max_len(executor: Any, engine_config: EngineConfig) -> int:
    executor_len = getattr(executor, "max_model_len", None)
    if executor_len is None:
        executor.initialize()
        executor_len = executor.max_model_len
    return int(executor_len)
