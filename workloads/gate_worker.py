"""One side of the paired CI gate: loads a tree's engine once, runs the gate workload on command.

Run as a script by `workloads.paired_gate` with `PYTHONPATH=<tree>` and the tree as working
directory, so `engine` is that tree's engine (the baseline commit's or the candidate's). It
therefore imports nothing from `workloads` or `conf`, which the baseline tree may not have in
this form: only the standard library, torch and the engine's public offline API (`LLM`,
`SamplingParams`, `EngineConfig`).

Protocol (one JSON object per line): the first stdin line is the job
`{"engine": {section: {key: value}}, "requests": [{"prompt_token_ids", "max_tokens"}],
"warmup_runs": int}`; the worker loads the engine, runs the warm-up, answers `{"ready": ...}`;
then each `run` line is answered with one rep's measures (`measure_rep`), each `explain` line
with one profiled rep (workloads/explain_probe.py, loaded by path beside this file), `quit` ends it.
Protocol lines go to the original stdout; everything else the engine prints goes to stderr.

`--test-slowdown F` (TEST ONLY: measuring the gate's power, benchmarks/gate_power.py) installs
`SlowForward(F)` through the engine's observation hooks (engine/hooks.py, `EngineCore.set_hooks`):
after every forward it spins on the thread's CPU clock for F times the CPU time that forward
took, so the engine's forward path carries no test code of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from engine.hooks import NullHooks

PHASES = ("schedule", "prepare", "forward", "sample")


def _protocol_out() -> Any:
    """A private copy of stdout for protocol lines; fd 1 then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def spin_cpu(seconds: float) -> None:
    """Busy-wait until this thread has used `seconds` more CPU time (so CPU clocks see it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class SlowForward(NullHooks):
    """TEST ONLY step hooks (the engine/hooks.py `StepHooks` protocol): every "forward" phase
    ends with a spin of `fraction` times the thread CPU time the phase took; other phases, and
    a fraction of 0, only count. The spin runs inside the phase, so the engine's forward time
    and the process's CPU time both include it."""

    def __init__(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 10.0:
            raise ValueError(f"--test-slowdown: expected a fraction in [0, 10], got {fraction}")
        self.fraction = fraction
        self.forwards = 0  # forward phases seen
        self.forward_cpu_s = 0.0  # their thread CPU time, before the spin
        self.spun_s = 0.0  # thread CPU time spent spinning

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name != "forward":
            yield
            return
        c0 = time.thread_time()
        yield
        c1 = time.thread_time()
        self.forwards += 1
        self.forward_cpu_s += c1 - c0
        if self.fraction:
            spin_cpu(self.fraction * (c1 - c0))
            self.spun_s += time.thread_time() - c1


def install_slowdown(llm: Any, fraction: float) -> SlowForward | None:
    """Installs `SlowForward(fraction)` on the engine; None (and a line on stderr) where the tree's
    engine has no `set_hooks` and the fraction is 0 (an old baseline: nothing to slow)."""
    hooks = SlowForward(fraction)
    core = getattr(llm, "engine_core", None)
    if not hasattr(core, "set_hooks"):
        if fraction:
            raise RuntimeError("--test-slowdown: this tree's engine has no EngineCore.set_hooks")
        print("gate worker: no EngineCore.set_hooks in this tree; no hook installed", file=sys.stderr)
        return None
    core.set_hooks(hooks)
    return hooks


def known_sections(config_cls: Any, sections: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`sections` less the sections and keys this tree's EngineConfig does not have (the job is
    composed from the candidate's conf/: a key added since the baseline would stop its worker);
    each one dropped is a line on stderr, with its value, in the worker's log."""
    import dataclasses

    known: dict[str, set[str]] = {}
    for f in dataclasses.fields(config_cls):
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(sample := factory()):
            known[f.name] = {g.name for g in dataclasses.fields(sample)}
    out: dict[str, dict[str, Any]] = {}
    for name, values in sections.items():
        for key, value in values.items():
            if key in known.get(name, ()):
                out.setdefault(name, {})[key] = value
            else:
                print(f"gate worker: this tree's engine has no {name}.{key}; dropped ({value!r})", file=sys.stderr)
    return out


def build_llm(job: dict[str, Any]) -> Any:
    from engine import LLM  # the public name (the front end's module moved in issue 56)
    from engine.config import EngineConfig

    sections = job["engine"]
    pinned = sections.get("kernels", {}).get("float32_linear")
    if pinned in ("prepacked", "plain") and not hasattr(EngineConfig(), "kernels"):
        # a tree from before KernelsConfig reads the pin from its old variable (paired_gate.pinned_probes)
        os.environ["SERVELAB_ONEDNN_FP32"] = "1" if pinned == "prepacked" else "0"
    if hasattr(EngineConfig, "from_sections"):
        sections = known_sections(EngineConfig, sections)
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


def explain_rep(llm: Any, job: dict[str, Any], hooks: Any) -> dict[str, Any]:
    """One profiled rep for servelab-explain (explain_probe.profiled_rep), the installed hooks kept
    inside its ranges; the probe is loaded by path: this tree's `workloads` may not have it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("explain_probe", os.path.join(os.path.dirname(__file__), "explain_probe.py"))
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    if not hasattr(llm.engine_core, "set_hooks"):
        return {"error": "this tree's engine has no EngineCore.set_hooks: nothing to profile by phase"}
    return probe.profiled_rep(llm, job["requests"], hooks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gate_worker")
    parser.add_argument("--test-slowdown", type=float, default=None, help="TEST ONLY (module docstring)")
    args = parser.parse_args(argv)
    out = _protocol_out()
    t0 = time.perf_counter()
    import torch  # while the gate composes the job

    from engine import LLM  # noqa: F401  (the import's time, while the gate composes the job)

    job = json.loads(sys.stdin.readline())
    torch.set_num_threads(int(job.get("threads", 1)))
    t1 = time.perf_counter()
    llm = build_llm(job)
    hooks = install_slowdown(llm, args.test_slowdown) if args.test_slowdown is not None else None
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
        if command == "explain":
            out.write(json.dumps(explain_rep(llm, job, hooks)) + "\n")
            continue
        if command != "run":
            out.write(json.dumps({"error": f"unknown command {command!r}"}) + "\n")
            continue
        out.write(json.dumps(measure_rep(llm, job)) + "\n")
    llm.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
