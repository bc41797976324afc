"""servelab-plan: capacity planning on the simulator (the engine's own scheduler, modelled time).

For a model shape, a hardware profile and a tensor-parallel size, it replays a workload (a
trace slice, or synthetic Poisson traffic) through `workloads.simulate.simulate` for every
candidate engine configuration (token budget x max_num_seqs) at every offered request rate,
and reports throughput, mean / p99 TTFT and TPOT, goodput, KV utilisation and preemptions. A
configuration meets the SLOs when the chosen statistic (p99 or mean) of TTFT and TPOT is
within the limits and every request completed. The best point is the highest rate that meets
the SLOs (ties: higher goodput).

It takes the same Hydra overrides as servelab-run (conf/plan.yaml, typed by
`conf.schema.PlanConfig`: model / scheduler / cache / workload / sim / slo, plus `plan:`):

    servelab-plan model=llama-3-70b sim.hardware=h200 sim.tp=8 workload=azure_conv \
        workload.trace.max_requests=2000 slo.ttft_ms=2000 slo.tpot_ms=100 \
        plan.max_num_batched_tokens=[2048,8192] plan.max_num_seqs=[128,256] \
        plan.search=true plan.target_rate=50 plan.out=runs/plan

Load: `plan.rates` lists request rates (req/s). A trace is replayed with its timestamps
rescaled to each mean rate (its burst shape kept); `plan.time_scales` gives multipliers of the
trace's own rate instead. `plan.search=true` finds, per configuration, the highest rate that
meets the SLOs (doubling, then bisection: `workloads.rate_search.find_max_rate`), starting at
`plan.search_start` (default: the trace's own rate, synthetic 1 req/s) and never above
`plan.search_max`. `plan.target_rate` adds the number of replicas of the best configuration
needed for that total rate. The old `--flag` options still work as aliases (`workloads.plan_cli.FLAG_ALIASES`,
docs/capacity.md lists the mapping; the command line lives there).

Writes plan.csv (one row per simulated run), plan.json (the planned settings, rows, best,
replicas, search curves) and plan.html (the curves: TTFT and TPOT statistic against the rate,
one line per configuration, the SLO as a dashed line).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from conf.schema import PlanConfig
from engine.config import EngineConfig
from engine.sim.executor import SimulatedExecutor
from engine.sim.hardware import HardwareProfile
from engine.sim.model_counts import load_arch
from workloads.factory import resolve_path
from workloads.plan_output import pareto, render, render_pareto, write
from workloads.plan_verify import render_verify, verify
from workloads.rate_search import SLO, find_max_rate, replicas_for_rate
from workloads.saturation import saturation_summary
from workloads.simulate import simulate, trace_token_specs
from workloads.spec import RequestSpec
from workloads.traces import TraceRow, fit_to_context, load_trace, scale_time, slice_rows

SEARCH_MAX_RATE = 1e6  # req/s: the default upper bound of plan.search


class PlanError(Exception):
    """A user error: printed as one line, no traceback."""


def check_search_args(p: Any) -> None:
    """plan.search_tol, plan.search_max and an explicit plan.search_start: positive, finite, start <= max."""
    if not (math.isfinite(p.search_tol) and p.search_tol > 0):
        raise PlanError(f"plan.search_tol (--search-tol) must be a number > 0, got {p.search_tol:g}")
    if not (math.isfinite(p.search_max) and p.search_max > 0):
        raise PlanError(f"plan.search_max (--search-max) must be a finite rate > 0 (req/s), got {p.search_max:g}")
    start = p.search_start
    if start is not None:
        if not (math.isfinite(start) and start > 0):
            raise PlanError(f"plan.search_start (--search-start) must be a finite rate > 0 (req/s), got {start:g}")
        if start > p.search_max:
            raise PlanError(f"plan.search_start {start:g} req/s is above plan.search_max {p.search_max:g} req/s")


def search_start(p: Any, workload: Workload) -> float:
    """The first rate of the search: plan.search_start, else the trace's own rate (synthetic:
    1 req/s), which must lie within (0, plan.search_max]."""
    if p.search_start is not None:
        return float(p.search_start)
    natural = workload.natural_rate if not workload.synthetic else 1.0
    what = "the trace's own rate" if not workload.synthetic else "the default start"
    if not (math.isfinite(natural) and natural > 0):
        raise PlanError(f"{what} ({natural:g} req/s) cannot start the search; give plan.search_start")
    if natural > p.search_max:
        raise PlanError(
            f"{what}, {natural:.4g} req/s (where the search starts by default), is above plan.search_max "
            f"{p.search_max:g} req/s; give plan.search_start <= {p.search_max:g} or raise plan.search_max"
        )
    return natural

@dataclass
class Workload:
    """Trace rows (arrival shape and lengths) or a synthetic Poisson recipe."""

    rows: list[TraceRow]
    natural_rate: float  # requests/s of the rows as given (trace) or 0 (synthetic: drawn per rate)
    synthetic: bool
    seed: int

    def specs(self, rate: float, vocab_size: int) -> tuple[list[RequestSpec], float]:
        """Specs at `rate` req/s and the time scale applied (1.0 for synthetic)."""
        if self.synthetic:
            return trace_token_specs(self.synthetic_rows(rate), vocab_size, seed=self.seed), 1.0
        k = rate / self.natural_rate
        return trace_token_specs(scale_time(self.rows, k), vocab_size, seed=self.seed), k

    def synthetic_rows(self, rate: float) -> list[TraceRow]:
        """Synthetic: the rows with the Poisson arrivals at `rate` the planner simulates (its seed)."""
        times = np.cumsum(np.random.default_rng(self.seed).exponential(1.0 / rate, size=len(self.rows)))
        return [TraceRow(float(t), r.prompt_tokens, r.output_tokens) for t, r in zip(times, self.rows, strict=True)]


def positive(values: list[Any] | None, name: str) -> list[Any]:
    """A non-empty list of values > 0 (a candidate or load list)."""
    if not values or any(not (isinstance(v, int | float) and v > 0) for v in values):
        raise PlanError(f"{name}: values must be numbers > 0, got {values!r}")
    return list(values)


def load_workload(cfg: PlanConfig, max_context: int) -> Workload:
    w = cfg.workload
    if w.kind == "trace":
        if not w.trace.path:
            raise PlanError("workload.trace.path is required for workload.kind=trace")
        path = resolve_path(w.trace.path)
        if not path.is_file():
            raise PlanError(f"trace not found: {w.trace.path}")
        try:
            rows, _ = load_trace(path)
        except (ValueError, KeyError) as e:
            raise PlanError(f"cannot read trace {w.trace.path}: {e}") from None
        rows = slice_rows(rows, first_n=w.trace.max_requests, start_s=w.trace.start_s, end_s=w.trace.end_s)
        if len(rows) < 2:
            raise PlanError("the trace slice holds fewer than 2 requests")
        rows = fit_to_context(rows, max_context)
        span = rows[-1].timestamp_s - rows[0].timestamp_s
        if span <= 0:
            raise PlanError("the trace slice has no time span (all arrivals at once)")
        return Workload(rows, (len(rows) - 1) / span, False, int(w.seed))
    if w.kind != "synthetic":
        raise PlanError(f"workload.kind: unknown {w.kind!r} (synthetic|trace)")
    if cfg.plan.time_scales:
        raise PlanError("plan.time_scales (--time-scales) needs a trace (workload.kind=trace)")
    for name, dist in (("prompt_len", w.prompt_len), ("output_len", w.output_len)):
        if dist.dist != "fixed":
            raise PlanError(f"workload.{name}.dist: the planner's synthetic traffic has fixed lengths, got {dist.dist!r}")
    num, prompt_len, output_len = int(w.num_requests), int(w.prompt_len.value), int(w.output_len.value)
    if min(num, prompt_len, output_len) < 1:
        raise PlanError("workload.num_requests, workload.prompt_len.value and workload.output_len.value must be >= 1")
    if prompt_len + output_len > max_context:
        raise PlanError(f"prompt + output ({prompt_len + output_len}) exceed the context {max_context}")
    rows = [TraceRow(0.0, prompt_len, output_len) for _ in range(num)]
    return Workload(rows, 0.0, True, int(w.seed))


def slo_of(cfg: PlanConfig) -> tuple[SLO, dict[str, float | None]]:
    """The run-level SLO (stat of TTFT/TPOT, all completed) and the per-request one (goodput)."""
    stat = cfg.plan.slo_stat
    if stat not in STATS:
        raise PlanError(f"plan.slo_stat: one of {', '.join(STATS)}, got {stat!r}")
    limits = {}
    for name, v in (("ttft", cfg.slo.ttft_ms), ("tpot", cfg.slo.tpot_ms)):
        if v is not None:
            if v <= 0:
                raise PlanError(f"slo.{name}_ms must be > 0")
            limits[f"{stat}_{name}_ms"] = v
    return SLO(max=limits, min={"completed_fraction": 1.0}), {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms}


STATS = ("p99", "mean", "p90", "p95", "median")


class Planner:
    """Runs the simulator for one configuration at one rate; keeps every row."""

    def __init__(self, cfg: PlanConfig) -> None:
        self.cfg = cfg
        self.model, self.sim = cfg.model.model, cfg.sim
        try:
            # A shape given by model.arch goes to a scratch file, like any other shape file.
            shape_dir = tempfile.mkdtemp(prefix="servelab-plan-") if cfg.model.arch else None
            self.base = cfg.engine_config(shape_dir=shape_dir)
            self.arch = load_arch(self.base.model.model)
            self.hw = HardwareProfile.load(self.sim.hardware)
        except FileNotFoundError as e:
            raise PlanError(str(e)) from None
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"bad model or hardware config: {e}") from None
        if self.sim.tp < 1:
            raise PlanError("sim.tp (--tp) must be >= 1")
        try:
            self.tp, self.ep = cfg.sim_parallel()
        except ValueError as e:
            raise PlanError(str(e)) from None
        self.slo, self.request_slo = slo_of(cfg)
        self.rows: list[dict[str, Any]] = []
        self.workload: Workload | None = None

    def config(self, budget: int, seqs: int) -> EngineConfig:
        """The plan's engine sections with one candidate's token budget and sequence limit."""
        c = self.base
        cfg = EngineConfig(model=replace(c.model), cache=replace(c.cache), attention=replace(c.attention),
                           device=replace(c.device),
                           scheduler=replace(c.scheduler, max_num_batched_tokens=budget, max_num_seqs=seqs))  # fmt: skip
        cfg.validate()
        return cfg

    def executor(self, cfg: EngineConfig) -> SimulatedExecutor:
        s = self.sim
        try:
            ex = SimulatedExecutor.from_names(cfg, self.arch, s.hardware, tp=self.tp, step_model=s.step_model,
                                              dtype=s.dtype, gpu_memory_utilization=s.gpu_memory_utilization,
                                              ep=self.ep)  # fmt: skip
            num_blocks = ex.initialize()
        except FileNotFoundError as e:
            raise PlanError(str(e)) from None
        except (ValueError, KeyError) as e:
            raise PlanError(f"cannot simulate {self.model} on {self.tp} x {s.hardware}: {e}") from None
        if num_blocks <= 0:
            raise PlanError(
                f"{self.model} does not fit on {self.tp} x {s.hardware} (no memory left for the KV cache)"
            )
        return ex

    def ensure_workload(self, budget: int, seqs: int) -> Workload:
        """The workload, fitted to the context the engine would have (loaded once)."""
        if self.workload is None:
            self.workload = load_workload(self.cfg, self.executor(self.config(budget, seqs)).max_model_len)
        return self.workload

    def run(self, budget: int, seqs: int, rate: float) -> dict[str, Any]:
        cfg = self.config(budget, seqs)
        ex = self.executor(cfg)
        workload = self.ensure_workload(budget, seqs)
        specs, k = workload.specs(rate, self.arch.vocab_size)
        res = simulate(specs, cfg, ex, slo=self.request_slo, progress=self.cfg.plan.progress)
        summ = res.summary()
        usage = [s.kv_blocks_used / s.kv_blocks_total for s in res.steps if s.kv_blocks_total]
        done = summ["completed"]
        summ["completed_fraction"] = done / len(specs) if specs else 0.0
        bad = self.slo.violations(_filled(summ))
        saturated = saturation_summary(res.records)["saturated"]
        if saturated:
            bad.append("saturated")
        row = {
            "max_num_batched_tokens": budget, "max_num_seqs": seqs, "rate": rate,
            "time_scale": None if workload.synthetic else k, "requests": len(specs), "completed": done,
            "request_throughput": summ["request_throughput"], "output_throughput": summ["output_throughput"],
            "mean_ttft_ms": summ["mean_ttft_ms"], "p99_ttft_ms": summ["p99_ttft_ms"],
            "mean_tpot_ms": summ["mean_tpot_ms"], "p99_tpot_ms": summ["p99_tpot_ms"],
            "request_goodput": summ["request_goodput"],
            "goodput_fraction": (summ["request_goodput"] / summ["request_throughput"]
                                 if summ["request_goodput"] is not None and summ["request_throughput"] else None),
            "mean_kv_usage": float(np.mean(usage)) if usage else 0.0,
            "max_kv_usage": float(np.max(usage)) if usage else 0.0,
            "num_preemptions": summ["num_preemptions"], "sim_s": res.sim_s, "wall_s": res.wall_s,
            "saturated": saturated, "meets_slo": not bad, "violations": "; ".join(bad),
        }  # fmt: skip
        self.rows.append(row)
        print(f"  budget {budget:>6} seqs {seqs:>4} rate {rate:>9.4g} req/s: "
              f"{'meets SLOs' if not bad else 'violates ' + row['violations']} ({res.wall_s:.1f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        return {**summ, **row}


def _filled(summary: dict[str, Any]) -> dict[str, Any]:
    """None statistics (no sample) read as +inf for max limits: no evidence is no pass."""
    return {k: (math.inf if v is None else v) for k, v in summary.items()}


def best_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Highest rate meeting the SLOs; ties by goodput, then throughput."""
    ok = [r for r in rows if r["meets_slo"]]
    if not ok:
        return None
    return max(ok, key=lambda r: (r["rate"], r["request_goodput"] or 0.0, r["output_throughput"]))


def settings_of(cfg: PlanConfig) -> dict[str, Any]:
    """What was planned, flat (plan.json "args", read by plan.html and by people)."""
    p, w = cfg.plan, cfg.workload
    return {
        "model": cfg.model.model, "hardware": cfg.sim.hardware, "tp": cfg.sim_parallel()[0],
        "ep": cfg.sim_parallel()[1], "dtype": cfg.sim.dtype,
        "step_model": cfg.sim.step_model, "num_blocks": cfg.cache.num_blocks,
        "gpu_memory_utilization": cfg.sim.gpu_memory_utilization,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        "workload": w.kind, "trace": w.trace.path if w.kind == "trace" else None,
        "first_n": w.trace.max_requests, "start_s": w.trace.start_s, "end_s": w.trace.end_s,
        "num_requests": w.num_requests, "prompt_len": w.prompt_len.value, "output_len": w.output_len.value,
        "seed": w.seed, "slo_ttft_ms": cfg.slo.ttft_ms, "slo_tpot_ms": cfg.slo.tpot_ms,
        **{k: getattr(p, k) for k in (
            "max_num_batched_tokens", "max_num_seqs", "rates", "time_scales", "search", "search_start",
            "search_tol", "search_max", "target_rate", "slo_stat", "out", "verify")},
    }  # fmt: skip


def check_plan_args(cfg: PlanConfig) -> None:
    """One load option, an SLO for a search, valid search bounds, target rate and verify count."""
    p = cfg.plan
    if sum(bool(x) for x in (p.rates, p.time_scales, p.search)) != 1:
        raise PlanError("give exactly one of plan.rates, plan.time_scales, plan.search=true "
                        "(--rates, --time-scales, --search)")  # fmt: skip
    if p.search and not (cfg.slo.ttft_ms or cfg.slo.tpot_ms):
        raise PlanError("plan.search needs an SLO (slo.ttft_ms and/or slo.tpot_ms)")
    if p.search:
        check_search_args(p)
    if p.target_rate is not None and p.target_rate <= 0:
        raise PlanError("plan.target_rate must be > 0")
    if p.verify < 0:
        raise PlanError(f"plan.verify: the number of picks to run for real, >= 0, got {p.verify}")


def plan(cfg: PlanConfig) -> dict[str, Any]:
    """Run every candidate; returns the plan.json dict."""
    p = cfg.plan
    budgets = positive(p.max_num_batched_tokens or [cfg.scheduler.max_num_batched_tokens],
                       "plan.max_num_batched_tokens")  # fmt: skip
    seqs_list = positive(p.max_num_seqs or [cfg.scheduler.max_num_seqs], "plan.max_num_seqs")
    check_plan_args(cfg)
    rates = positive(p.rates, "plan.rates") if p.rates else None
    scales = positive(p.time_scales, "plan.time_scales") if p.time_scales else None
    planner = Planner(cfg)
    searches: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for budget in budgets:
        for seqs in seqs_list:
            if p.search:
                # Start at the trace's own rate (synthetic: 1 req/s) unless told; never above search_max.
                start = search_start(p, planner.ensure_workload(budget, seqs))

                def run_at(rate: float, b: int = budget, s: int = seqs) -> dict[str, Any]:
                    return planner.run(b, s, rate)

                result = find_max_rate(run_at, planner.slo, start=start, rate_limit=p.search_max,
                                       rel_tol=p.search_tol)  # fmt: skip
                searches.append({"max_num_batched_tokens": budget, "max_num_seqs": seqs,
                                 "max_rate": result.max_rate,
                                 "curve": [(e.rate, e.ok) for e in result.evaluations]})  # fmt: skip
                continue
            if rates is None:
                natural = planner.ensure_workload(budget, seqs).natural_rate
                rates_here = [k * natural for k in scales or []]
            else:
                rates_here = rates
            for rate in sorted(rates_here):
                if planner.run(budget, seqs, rate)["saturated"]:
                    break  # a higher rate only queues faster: stop climbing at the first saturated one
    rows = sorted(planner.rows, key=lambda r: (r["max_num_batched_tokens"], r["max_num_seqs"], r["rate"]))
    best = best_row(rows)
    out: dict[str, Any] = {
        "args": settings_of(cfg),
        "slo": {"max": dict(planner.slo.max), "min": dict(planner.slo.min)},
        "rows": rows, "best": best, "searches": searches, "wall_s": time.perf_counter() - t0,
        "pareto": pareto(rows, cfg.sim_parallel()[0]),
    }  # fmt: skip
    if p.target_rate is not None:
        out["replicas"] = replicas_for_rate(p.target_rate, best["rate"]) if best else None
    render(rows, best, p.plain)
    render_pareto(out["pareto"])
    if p.target_rate is not None:
        msg = (
            f"{out['replicas']} replica(s) of the best configuration serve {p.target_rate:.4g} req/s"
            if best
            else "no replica count: no configuration met the SLOs"
        )
        print(f"replicas: {msg}")
    if p.verify:
        w = planner.workload
        out["verify"] = verify(cfg, rows, p.verify, w.synthetic_rows if w is not None and w.synthetic else None)
        render_verify(out["verify"])
    if p.out is not None:
        write(Path(p.out), rows, out)
        print(f"wrote plan.csv, plan.json and plan.html to {p.out}")
    return out
