"""target=offline: every request handed to `LLM.generate` at once (vLLM's offline benchmark shape).

Arrival times are ignored; scheduling is then deterministic, which is what the CI gate compares
(steps, tokens per step, prefix hits, preemptions). No driver: the kind runs the experiment
itself and returns what it measured (`Ran`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conf.schema import RunConfig
from engine.config import EngineConfig
from workloads.driver import RunResult
from workloads.factory import plan_workload
from workloads.targets.build import Ran, hooks_factory
from workloads.time_reference import timed


def run_offline(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> Ran:
    from engine.frontend.llm import LLM
    from workloads.record_builder import build_record
    from workloads.targets.engine import sampling_params_for

    llm = LLM(config=engine_config)
    compile_time_s = llm.engine_core.executor.compile_time
    factory = hooks_factory(cfg, run_dir)
    if factory is not None:
        llm.engine_core.set_hooks(factory())
    try:
        specs, _ = plan_workload(cfg, llm.tokenizer, llm.engine_core.max_model_len, run_dir)
        prompts = [s.prompt_token_ids if s.prompt_token_ids is not None else s.prompt for s in specs]
        params = [sampling_params_for(s) for s in specs]

        def generate_all() -> tuple[list[Any], float, float]:
            t0_wall, t0 = time.time(), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=True)
            return outs, t0_wall, time.perf_counter() - t0

        (outs, t0_wall, done), reference = timed(cfg, generate_all)
    finally:
        llm.engine_core.shutdown()
    records = []
    for spec, out in zip(specs, outs, strict=True):
        comp = out.outputs[0]
        m = out.metrics
        records.append(build_record(
            spec, scheduled_s=0.0, start_s=0.0, token_times=[t - t0_wall for t in m.token_times], done_s=done,
            prompt_tokens=len(out.prompt_token_ids), output_tokens=len(comp.token_ids),
            finish_reason=comp.finish_reason or "",
            server_queued_s=m.queued_time, server_prefill_s=m.prefill_time, server_decode_s=m.decode_time,
            spec_draft_tokens=m.num_draft_tokens, spec_accepted_tokens=m.num_accepted_tokens,
            kv=m.kv_figures() if m.kv_bytes_loaded or m.kv_bytes_saved else None,
        ))
    result = RunResult(records=records, t0_wall=t0_wall, wall_s=done, steps=llm.step_stats)
    return Ran(result, reference, compile_time_s)
