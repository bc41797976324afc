"""One side of the paired CI gate: loads a tree's engine once, runs the gate workload on command.

Run as a script by `workloads.paired_gate` with `PYTHONPATH=<tree>` and the tree as working
directory, so `engine` is that tree's engine (the baseline commit's or the candidate's). It
therefore imports nothing from `workloads` or `conf`, which the baseline tree may not have in
this form: only the standard library, torch and the engine's public offline API (`LLM`,
`SamplingParams`, `EngineConfig`).

Protocol (one JSON object per line): the first stdin line is the job
`{"engine": {section: {key: value}}, "requests": [{"prompt_token_ids", "max_tokens"}],
"warmup_runs": int}`; the worker loads the engine, runs the warm-up, answers `{"ready": ...}`;
then each `run` line is answered with one rep's measures (`measure_rep`), `quit` ends it.
Protocol lines go to the original stdout; everything else the engine prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

PHASES = ("schedule", "prepare", "forward", "sample")


def _protocol_out() -> Any:
    """A private copy of stdout for protocol lines; fd 1 then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def build_llm(job: dict[str, Any]) -> Any:
    from engine.config import EngineConfig
    from engine.llm import LLM

    sections = job["engine"]
    if hasattr(EngineConfig, "from_sections"):
        return LLM(config=EngineConfig.from_sections(sections))
    flat = {k: v for section in sections.values() for k, v in section.items()}
    return LLM(model=flat.pop("model"), **flat)  # an older engine: flat engine arguments


def measure_rep(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Runs the workload once from a cold prefix cache; returns its measures.

    Time: wall seconds, this process's CPU seconds (all threads) per output token, and the
    median over steps of each engine phase (the StepStats fields steps.csv records).
    Exact: steps, tokens per step, prefix-cache hit rate, preemptions, output tokens.
    """
    from engine.sampling_params import SamplingParams

    prompts = [r["prompt_token_ids"] for r in job["requests"]]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in job["requests"]]
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    llm.step_stats.clear()
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = list(llm.step_stats)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    scheduled = sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
    queries = sum(s.prefix_cache_queries for s in steps)
    rep: dict[str, Any] = {
        "wall_s": wall,
        "cpu_ms_per_token": 1e3 * cpu / max(tokens, 1),
        "step_ms": 1e3 * statistics.median(s.step_time for s in steps) if steps else 0.0,
        "num_steps": len(steps),
        "mean_tokens_per_step": scheduled / max(len(steps), 1),
        "prefix_cache_hit_rate": sum(s.prefix_cache_hits for s in steps) / queries if queries else 0.0,
        "num_preemptions": sum(s.num_preemptions for s in steps),
        "output_tokens": tokens,
    }
    for phase in PHASES:
        values = [getattr(s, f"{phase}_time", 0.0) for s in steps]
        rep[f"{phase}_ms"] = 1e3 * statistics.median(values) if values else 0.0
    return rep


def main() -> int:
    out = _protocol_out()
    t0 = time.perf_counter()
    import torch  # while the gate composes the job

    import engine.llm  # noqa: F401

    job = json.loads(sys.stdin.readline())
    torch.set_num_threads(int(job.get("threads", 1)))
    t1 = time.perf_counter()
    llm = build_llm(job)
    t2 = time.perf_counter()
    for _ in range(int(job.get("warmup_runs", 1))):
        measure_rep(llm, job)
    t3 = time.perf_counter()
    print(f"gate worker: imports {t1 - t0:.1f} s, engine {t2 - t1:.1f} s, warm-up {t3 - t2:.1f} s", file=sys.stderr)
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            out.write(json.dumps({"error": f"unknown command {command!r}"}) + "\n")
            continue
        out.write(json.dumps(measure_rep(llm, job)) + "\n")
    llm.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
