"""One profiled rep of a workload, step by step: what `servelab-explain` decomposes.

Imports only the standard library and torch (the gate worker loads this file by path next to a
baseline tree's engine, which may predate the workbench), and touches the engine only through
its public surface: `LLM.generate`, `llm.step_stats`, `EngineCore.set_hooks` (engine/hooks.py)
and torch module hooks on the model.

`profiled_rep(llm, requests, inner)` runs the requests once under torch.profiler with:
- a `record_function` range around every engine phase of every step (`ExplainHooks`, which wraps
  the `inner` hooks: the gate worker's or a test's; their work runs inside the range);
- a range around every module call of the model (`module_ranges`), named by its group:
  attention (LlamaAttention's own ops: rotary, the attention backend), linears (nn.Linear),
  mlp (the MLP's own ops: activation and anything hooked on it), norm, embedding.
The CPU forward's plan (engine/kernels/forward_plan.py and the C++ loop of planned_layers.cpp: the
same ops without module calls) runs as it runs unprofiled: its parts are ranges of their own,
`servelab::plan:<part>` with the same group names (norm, linears, attention, mlp), so a kernel of
engine/kernels/csrc that got slower is named by the part that calls it. The attention wrapper that
`EngineCore.set_hooks` installs (engine/hooks.observe_attention) is taken off for the rep, since a
wrapped backend keeps the plan from its one-call decode path. An engine whose plan names no parts
(a baseline tree older than them, no `PLAN_RANGE_PREFIX` in its forward_plan) has its plan set
aside for the rep instead, as before: its modules then run and name the same groups.
Each op's self time goes to the innermost module or plan-part range around it; ops in the forward
phase outside any are "lm head / logits" (compute_logits runs there).

Returned (JSON-ready): `{"wall_s", "output_tokens", "steps": [row, ...]}`, one row per step:
its composition (tokens, prefill tokens, requests, preemptions, prefix hits), its phase seconds
from StepStats (schedule, prepare, forward, sample, update, other = step_time minus those), and
`ops`: {"<group>|<op name>": [self ms, calls]} for the forward phase's ops.
analysis/explain.py decomposes the reps; it keeps its own copy of the phase names and `HOST_GROUP`
(tests/test_explain_stats.py checks they agree), since this file imports nothing of the workbench.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASE_PREFIX = "explain::phase:"
MODULE_PREFIX = "explain::module:"
PLAN_PREFIX = "servelab::plan:"  # engine/kernels/forward_plan.py PLAN_RANGE_PREFIX (the plan's part ranges)
# Engine phase name -> StepStats field and the name explain reports it under.
PHASE_FIELDS = {"schedule": "schedule_time", "prepare": "prepare_time", "forward": "forward_time",
                "sample": "sample_time", "update": "update_time"}  # fmt: skip
HOST_GROUP = "host"  # forward time outside every op (Python and dispatch between ops)
LM_HEAD_GROUP = "lm head / logits"


def module_group(module: torch.nn.Module) -> str | None:
    """The group a module's own ops are reported under; None for containers (their children tell)."""
    name = type(module).__name__
    if isinstance(module, torch.nn.Linear):
        return "linears"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if "Attention" in name:
        return "attention"
    if "MLP" in name or "MoE" in name:
        return "mlp"
    if "Norm" in name:
        return "norm"
    return None


class ExplainHooks:
    """engine/hooks.py `StepHooks`: a `record_function` range per phase, named with its step,
    around the `inner` hooks' own phase (so whatever `inner` does there is inside the range)."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.step = -1

    def step_begin(self, step: int) -> None:
        self.step = step
        if self.inner is not None:
            self.inner.step_begin(step)

    def step_end(self) -> None:
        if self.inner is not None:
            self.inner.step_end()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        inner = self.inner.phase(name) if self.inner is not None else contextlib.nullcontext()
        with record_function(f"{PHASE_PREFIX}{name}#{self.step}"), inner:
            yield


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module) -> Iterator[None]:
    """Every grouped module call inside a `record_function` range (see the module docstring).

    Install after any other hook on the model: the closing hook then runs after theirs, so what
    they do counts for the module."""
    handles, ranges = [], []  # ranges: the open record_function objects, innermost last

    def enter(group: str) -> Any:
        def pre(_module: torch.nn.Module, _args: Any) -> None:
            r = record_function(MODULE_PREFIX + group)
            r.__enter__()
            ranges.append(r)

        return pre

    def leave(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if ranges:
            ranges.pop().__exit__(None, None, None)

    for module in model.modules():
        group = module_group(module)
        if group is not None:
            handles.append(module.register_forward_pre_hook(enter(group)))
            handles.append(module.register_forward_hook(leave))
    inner = getattr(model, "model", None)
    plan = getattr(inner, "plan", None)
    set_aside = plan is not None and not plan_names_parts()
    if set_aside:  # an engine older than the plan's part ranges: its modules run instead
        inner.plan = None  # type: ignore[union-attr]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if set_aside:
            inner.plan = plan  # type: ignore[union-attr]


def plan_names_parts() -> bool:
    """Whether this process's engine runs its CPU forward plan in named part ranges (PLAN_PREFIX)."""
    forward_plan = sys.modules.get("engine.kernels.forward_plan")
    return getattr(forward_plan, "PLAN_RANGE_PREFIX", None) == PLAN_PREFIX


@contextlib.contextmanager
def unobserved_attention(llm: Any) -> Iterator[None]:
    """The attention backend without the phase wrapper that `EngineCore.set_hooks` gave it
    (engine/hooks.observe_attention, an instance attribute `forward`), put back on exit; with it
    the plan's decode step would call every layer from Python rather than in one C++ call."""
    backend = getattr(getattr(getattr(llm, "engine_core", None), "_runner", None), "attn_backend", None)
    wrapper = vars(backend).pop("forward", None) if backend is not None else None
    try:
        yield
    finally:
        if wrapper is not None:
            backend.forward = wrapper  # type: ignore[union-attr]


def find_model(llm: Any) -> torch.nn.Module | None:
    """The in-process engine's model (None where the executor holds it elsewhere)."""
    runner = getattr(getattr(llm, "engine_core", None), "_runner", None)
    model = getattr(runner, "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def _op_rows(prof: profile) -> dict[int, dict[str, list[float]]]:
    """{step: {"group|op": [self ms, calls]}} for ops inside a forward phase range."""
    out: dict[int, dict[str, list[float]]] = {}
    gpu = torch.cuda.is_available()
    for e in prof.events():
        if e.name.startswith(("explain::", PLAN_PREFIX)):
            continue
        group, step, parent = None, None, e.cpu_parent
        while parent is not None:  # up to the step's forward phase (other phases inside it: passed through)
            name = parent.name
            if group is None and name.startswith(MODULE_PREFIX):
                group = name[len(MODULE_PREFIX):]
            elif group is None and name.startswith(PLAN_PREFIX):
                group = name[len(PLAN_PREFIX):]
            elif name.startswith(PHASE_PREFIX):
                phase, _, n = name[len(PHASE_PREFIX):].partition("#")
                if phase == "forward":
                    step = int(n)
                    break
            parent = parent.cpu_parent
        if step is None:
            continue
        self_us = e.self_device_time_total if gpu else e.self_cpu_time_total
        cell = out.setdefault(step, {}).setdefault(f"{group or LM_HEAD_GROUP}|{e.name}", [0.0, 0])
        cell[0] += self_us / 1e3
        cell[1] += 1
    return out


def profiled_rep(llm: Any, requests: list[dict[str, Any]], inner: Any = None) -> dict[str, Any]:
    """Runs `requests` ({"prompt_token_ids", "max_tokens"}) once, greedy, from a cold prefix
    cache, profiled (module docstring); the engine's hooks are `inner` again afterwards."""
    from engine.sampling_params import SamplingParams

    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    core = llm.engine_core
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    llm.step_stats.clear()
    model = find_model(llm)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    core.set_hooks(ExplainHooks(inner))
    try:
        ranges = module_ranges(model) if model is not None else contextlib.nullcontext()
        with ranges, unobserved_attention(llm), profile(activities=activities) as prof:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
    finally:
        if inner is not None:
            core.set_hooks(inner)
        else:
            from engine.hooks import NULL_HOOKS

            core.set_hooks(NULL_HOOKS)
    ops = _op_rows(prof)
    steps = []
    for s in llm.step_stats:
        row: dict[str, Any] = {
            "step": s.step, "tokens": s.num_prefill_tokens + s.num_decode_tokens,
            "prefill_tokens": s.num_prefill_tokens, "requests": s.num_prefill_reqs + s.num_decode_reqs,
            "preemptions": s.num_preemptions, "prefix_hits": s.prefix_cache_hits,
        }  # fmt: skip
        for phase, field in PHASE_FIELDS.items():
            row[phase] = getattr(s, field, 0.0)
        row["other"] = max(s.step_time - sum(row[p] for p in PHASE_FIELDS), 0.0)
        row["ops"] = ops.get(s.step, {})
        steps.append(row)
    return {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "steps": steps}
