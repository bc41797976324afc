"""servelab-plan: capacity planning on the simulator (the engine's own scheduler, modelled time).

For a model (conf/model/*), a hardware profile (conf/hardware/*) and a tensor-parallel size,
it replays a workload (a trace slice, or synthetic Poisson traffic) through
`workloads.simulate.simulate` for every candidate engine configuration (token budget x
max_num_seqs) at every offered request rate, and reports throughput, mean / p99 TTFT and
TPOT, goodput, KV utilisation and preemptions. A configuration meets the SLOs when the
chosen statistic (p99 or mean) of TTFT and TPOT is within the limits and every request
completed. The best point is the highest rate that meets the SLOs (ties: higher goodput).

Load: `--rates` lists request rates (req/s). A trace is replayed with its timestamps
rescaled to each mean rate (its burst shape kept); `--time-scales` gives multipliers of the
trace's own rate instead. `--search` finds, per configuration, the highest rate that meets
the SLOs (doubling, then bisection: `workloads.rate_search.find_max_rate`), starting at
`--search-start` (default: the trace's own rate, synthetic 1 req/s) and never above
`--search-max`; a start outside (0, --search-max] is an error. `--target-rate` adds
the number of replicas of the best configuration needed for that total rate.

    servelab-plan --model llama-3-70b --hardware h200 --tp 8 \\
        --trace ../shared/traces/AzureLLMInferenceTrace_conv.csv --first-n 2000 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 100 --max-num-batched-tokens 2048,8192 \\
        --max-num-seqs 128,256 --search --target-rate 50 --out runs/plan

Writes plan.csv (one row per simulated run), plan.json (arguments, rows, best, replicas,
search curves) and plan.html (the curves: TTFT and TPOT statistic against the rate, one line
per configuration, the SLO as a dashed line).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import EngineConfig
from engine.sim.executor import SimulatedExecutor
from engine.sim.hardware import HardwareProfile
from engine.sim.model_counts import load_arch
from workloads.plan_output import render, write
from workloads.rate_search import SLO, find_max_rate, replicas_for_rate
from workloads.simulate import simulate, trace_token_specs
from workloads.spec import RequestSpec
from workloads.traces import TraceRow, fit_to_context, load_trace, scale_time, slice_rows

SEARCH_MAX_RATE = 1e6  # req/s: the default upper bound of --search


class PlanError(Exception):
    """A user error: printed as one line, no traceback."""


def check_search_args(args: argparse.Namespace) -> None:
    """--search-tol, --search-max and an explicit --search-start: positive, finite, start <= max."""
    if not (math.isfinite(args.search_tol) and args.search_tol > 0):
        raise PlanError(f"--search-tol must be a number > 0, got {args.search_tol:g}")
    if not (math.isfinite(args.search_max) and args.search_max > 0):
        raise PlanError(f"--search-max must be a finite rate > 0 (req/s), got {args.search_max:g}")
    start = args.search_start
    if start is not None:
        if not (math.isfinite(start) and start > 0):
            raise PlanError(f"--search-start must be a finite rate > 0 (req/s), got {start:g}")
        if start > args.search_max:
            raise PlanError(f"--search-start {start:g} req/s is above --search-max {args.search_max:g} req/s")


def search_start(args: argparse.Namespace, workload: Workload) -> float:
    """The first rate of the search: --search-start, else the trace's own rate (synthetic: 1 req/s),
    which must lie within (0, --search-max]."""
    if args.search_start is not None:
        return float(args.search_start)
    natural = workload.natural_rate if not workload.synthetic else 1.0
    what = "the trace's own rate" if not workload.synthetic else "the default start"
    if not (math.isfinite(natural) and natural > 0):
        raise PlanError(f"{what} ({natural:g} req/s) cannot start the search; give --search-start")
    if natural > args.search_max:
        raise PlanError(
            f"{what}, {natural:.4g} req/s (where the search starts by default), is above --search-max "
            f"{args.search_max:g} req/s; give --search-start <= {args.search_max:g} or raise --search-max"
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
            rng = np.random.default_rng(self.seed)
            times = np.cumsum(rng.exponential(1.0 / rate, size=len(self.rows)))
            rows = [
                TraceRow(float(t), r.prompt_tokens, r.output_tokens)
                for t, r in zip(times, self.rows, strict=True)
            ]
            return trace_token_specs(rows, vocab_size, seed=self.seed), 1.0
        k = rate / self.natural_rate
        return trace_token_specs(scale_time(self.rows, k), vocab_size, seed=self.seed), k


def _csv(kind: type, text: str, name: str) -> list[Any]:
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{name}: expected comma-separated {kind.__name__} values, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise PlanError(f"{name}: values must be > 0, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="servelab-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_argument_group("deployment")
    g.add_argument("--model", default="llama-3-70b", help="conf/model/<name>.yaml, a yaml or HF config.json")
    g.add_argument("--hardware", default="h200", help="conf/hardware/<name>.yaml or a yaml path")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--dtype", default="bf16", help="weight dtype: fp32|bf16|fp16|fp8")
    g.add_argument("--step-model", default="roofline", help="roofline or a calibration file (.json/.yaml)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: what fits the hardware)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    w = ap.add_argument_group("workload")
    w.add_argument(
        "--trace", type=Path, default=None, help="trace file (azure csv, mooncake/jsonl, burstgpt)"
    )
    w.add_argument("--first-n", type=int, default=None, help="trace: only the first N requests")
    w.add_argument("--start-s", type=float, default=None, help="trace: slice start (s)")
    w.add_argument("--end-s", type=float, default=None, help="trace: slice end (s)")
    w.add_argument("--num-requests", type=int, default=200, help="synthetic: requests per run")
    w.add_argument("--prompt-len", type=int, default=512, help="synthetic: prompt tokens")
    w.add_argument("--output-len", type=int, default=128, help="synthetic: output tokens")
    w.add_argument("--seed", type=int, default=0)
    load = ap.add_argument_group("load (one of)")
    load.add_argument("--rates", default=None, help="offered rates, req/s, comma-separated")
    load.add_argument("--time-scales", default=None, help="trace: multipliers of its own rate")
    load.add_argument("--search", action="store_true", help="search the highest rate meeting the SLOs")
    load.add_argument("--search-start", type=float, default=None, help="first rate of the search (req/s)")
    load.add_argument("--search-tol", type=float, default=0.05, help="relative tolerance of the search")
    load.add_argument("--search-max", type=float, default=SEARCH_MAX_RATE,
                      help=f"highest rate the search may try (req/s, default {SEARCH_MAX_RATE:g})")  # fmt: skip
    load.add_argument("--target-rate", type=float, default=None, help="total rate to serve: replicas needed")
    s = ap.add_argument_group("SLOs")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-stat", choices=("p99", "mean", "p90", "p95", "median"), default="p99")
    c = ap.add_argument_group("candidate configurations (comma-separated lists; every combination)")
    c.add_argument("--max-num-batched-tokens", default="8192")
    c.add_argument("--max-num-seqs", default="256")
    o = ap.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="folder for plan.csv and plan.json")
    o.add_argument("--plain", action="store_true", help="plain-text table (no rich)")
    o.add_argument("--progress", action="store_true", help="a progress bar per run")
    return ap


def load_workload(args: argparse.Namespace, max_context: int) -> Workload:
    if args.trace is not None:
        if not args.trace.is_file():
            raise PlanError(f"trace not found: {args.trace}")
        try:
            rows, _ = load_trace(args.trace)
        except (ValueError, KeyError) as e:
            raise PlanError(f"cannot read trace {args.trace}: {e}") from None
        rows = slice_rows(rows, first_n=args.first_n, start_s=args.start_s, end_s=args.end_s)
        if len(rows) < 2:
            raise PlanError("the trace slice holds fewer than 2 requests")
        rows = fit_to_context(rows, max_context)
        span = rows[-1].timestamp_s - rows[0].timestamp_s
        if span <= 0:
            raise PlanError("the trace slice has no time span (all arrivals at once)")
        return Workload(rows, (len(rows) - 1) / span, False, args.seed)
    if args.time_scales:
        raise PlanError("--time-scales needs --trace")
    if min(args.num_requests, args.prompt_len, args.output_len) < 1:
        raise PlanError("--num-requests, --prompt-len and --output-len must be >= 1")
    if args.prompt_len + args.output_len > max_context:
        raise PlanError(
            f"prompt + output ({args.prompt_len + args.output_len}) exceed the context {max_context}"
        )
    rows = [TraceRow(0.0, args.prompt_len, args.output_len) for _ in range(args.num_requests)]
    return Workload(rows, 0.0, True, args.seed)


def slo_of(args: argparse.Namespace) -> tuple[SLO, dict[str, float | None]]:
    """The run-level SLO (stat of TTFT/TPOT, all completed) and the per-request one (goodput)."""
    limits = {}
    for name, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms)):
        if v is not None:
            if v <= 0:
                raise PlanError(f"--slo-{name}-ms must be > 0")
            limits[f"{args.slo_stat}_{name}_ms"] = v
    return SLO(max=limits, min={"completed_fraction": 1.0}), {
        "ttft_ms": args.slo_ttft_ms,
        "tpot_ms": args.slo_tpot_ms,
    }


class Planner:
    """Runs the simulator for one configuration at one rate; keeps every row."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        try:
            self.arch = load_arch(args.model)
            self.hw = HardwareProfile.load(args.hardware)
        except FileNotFoundError as e:
            raise PlanError(str(e)) from None
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"bad model or hardware config: {e}") from None
        if args.tp < 1:
            raise PlanError("--tp must be >= 1")
        self.slo, self.request_slo = slo_of(args)
        self.rows: list[dict[str, Any]] = []
        self.workload: Workload | None = None

    def config(self, budget: int, seqs: int) -> EngineConfig:
        cfg = EngineConfig.from_kwargs(self.arch.name or self.args.model, max_num_batched_tokens=budget,
                                       max_num_seqs=seqs)  # fmt: skip
        cfg.cache.num_blocks = self.args.num_blocks
        cfg.cache.enable_prefix_caching = not self.args.no_prefix_caching
        return cfg

    def executor(self, cfg: EngineConfig) -> SimulatedExecutor:
        a = self.args
        try:
            ex = SimulatedExecutor.from_names(cfg, self.arch, a.hardware, tp=a.tp, step_model=a.step_model,
                                              dtype=a.dtype, gpu_memory_utilization=a.gpu_memory_utilization)  # fmt: skip
            num_blocks = ex.initialize()
        except FileNotFoundError as e:
            raise PlanError(str(e)) from None
        except (ValueError, KeyError) as e:
            raise PlanError(f"cannot simulate {a.model} on {a.tp} x {a.hardware}: {e}") from None
        if num_blocks <= 0:
            raise PlanError(
                f"{a.model} does not fit on {a.tp} x {a.hardware} (no memory left for the KV cache)"
            )
        return ex

    def ensure_workload(self, budget: int, seqs: int) -> Workload:
        """The workload, fitted to the context the engine would have (loaded once)."""
        if self.workload is None:
            self.workload = load_workload(self.args, self.executor(self.config(budget, seqs)).max_model_len)
        return self.workload

    def run(self, budget: int, seqs: int, rate: float) -> dict[str, Any]:
        cfg = self.config(budget, seqs)
        ex = self.executor(cfg)
        workload = self.ensure_workload(budget, seqs)
        specs, k = workload.specs(rate, self.arch.vocab_size)
        res = simulate(specs, cfg, ex, slo=self.request_slo, progress=self.args.progress)
        summ = res.summary()
        usage = [s.kv_blocks_used / s.kv_blocks_total for s in res.steps if s.kv_blocks_total]
        done = summ["completed"]
        summ["completed_fraction"] = done / len(specs) if specs else 0.0
        bad = self.slo.violations(_filled(summ))
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
            "meets_slo": not bad, "violations": "; ".join(bad),
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


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Run every candidate; returns the plan.json dict."""
    budgets = _csv(int, args.max_num_batched_tokens, "--max-num-batched-tokens")
    seqs_list = _csv(int, args.max_num_seqs, "--max-num-seqs")
    if (
        sum(x is not None and x is not False for x in (args.rates, args.time_scales, args.search or None))
        != 1
    ):
        raise PlanError("give exactly one of --rates, --time-scales, --search")
    if args.search and not (args.slo_ttft_ms or args.slo_tpot_ms):
        raise PlanError("--search needs an SLO (--slo-ttft-ms and/or --slo-tpot-ms)")
    if args.search:
        check_search_args(args)
    if args.target_rate is not None and args.target_rate <= 0:
        raise PlanError("--target-rate must be > 0")
    planner = Planner(args)
    searches: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for budget in budgets:
        for seqs in seqs_list:
            if args.search:
                # Start at the trace's own rate (synthetic: 1 req/s) unless told; never above --search-max.
                start = search_start(args, planner.ensure_workload(budget, seqs))

                def run_at(rate: float, b: int = budget, s: int = seqs) -> dict[str, Any]:
                    return planner.run(b, s, rate)

                result = find_max_rate(run_at, planner.slo, start=start, rate_limit=args.search_max,
                                       rel_tol=args.search_tol)  # fmt: skip
                searches.append({"max_num_batched_tokens": budget, "max_num_seqs": seqs,
                                 "max_rate": result.max_rate,
                                 "curve": [(e.rate, e.ok) for e in result.evaluations]})  # fmt: skip
                continue
            if args.rates:
                rates = _csv(float, args.rates, "--rates")
            else:
                scales = _csv(float, args.time_scales, "--time-scales")
                rates = [k * planner.ensure_workload(budget, seqs).natural_rate for k in scales]
            for rate in rates:
                planner.run(budget, seqs, rate)
    rows = sorted(planner.rows, key=lambda r: (r["max_num_batched_tokens"], r["max_num_seqs"], r["rate"]))
    best = best_row(rows)
    out: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "slo": {"max": dict(planner.slo.max), "min": dict(planner.slo.min)},
        "rows": rows, "best": best, "searches": searches, "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    if args.target_rate is not None:
        out["replicas"] = replicas_for_rate(args.target_rate, best["rate"]) if best else None
    render(rows, best, args.plain)
    if args.target_rate is not None:
        msg = (
            f"{out['replicas']} replica(s) of the best configuration serve {args.target_rate:.4g} req/s"
            if best
            else "no replica count: no configuration met the SLOs"
        )
        print(f"replicas: {msg}")
    if args.out is not None:
        write(args.out, rows, out)
        print(f"wrote plan.csv, plan.json and plan.html to {args.out}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan(args)
    except PlanError as e:
        print(f"servelab-plan: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"servelab-plan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("servelab-plan: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
