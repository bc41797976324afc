"""Fidelity of the simulator on this machine: calibrate on some real runs, predict others.

The default model (SmolLM2) runs in-process on the CPU on a slice of the Azure conversation
trace, its prompt and output lengths scaled down (default 1/8) so that a run takes about a
minute on 2 cores. Each real run replays the slice in real time through the same loop the
simulator uses (`workloads.simulate.replay` with `WallClock`): requests join at their
arrival time, the engine steps while it has work. Runs differ in request rate (the slice's
timestamps rescaled) and token budget (`max_num_batched_tokens`).

1. real runs: the calibration set and the held-out set (other rates and budgets), each
   `--repeats` times (default 2, round-robin); a run's measured metrics are the median over
   its repeats (with two, the mean of the two), and the table notes how far repeats differ;
2. `workloads.calibration.fit_step_model` on the per-step rows (steps.csv) of every repeat of the
   calibration runs only: by default (`--fit table`) an interpolated cost table in the step's
   token count plus linear per-request and KV-read terms, Huber-weighted (`--robust`);
   `--fit linear` is the plain linear fit;
3. every run simulated with that model (same specs, same KV blocks, same config);
4. a table of mean TTFT, mean TPOT and output throughput, measured vs predicted, % error
   (and the held-out worst error of the plain linear fit, for comparison).

    python benchmarks/sim_fidelity.py [--num-requests 40] [--length-scale 0.125]
        [--calibrate 1.0:128,3.0:512] [--holdout 2.0:256,4.0:64,1.5:64] [--threads 1]
        [--repeats 2] [--fit table|linear] [--tables num_tokens=auto] [--features ...]
        [--out runs/sim_fidelity]
    python benchmarks/sim_fidelity.py --reuse runs/sim_fidelity --fit linear --out /tmp/f
        # refit and re-simulate the real runs saved in a previous --out (no real run)

Rates are requests/s, budgets tokens/step. The machine is shared: step times are noisy.

Clock (`--clock`): `cpu` (default) times the real runs in this process's CPU seconds, with
idle gaps jumped over like the simulator does (`CpuClock`): other jobs on the 2 shared
cores then no longer stretch the measured steps, so the table compares the model with the
engine's own cost. `wall` uses the wall clock (what a client would see on this machine at
that moment, other jobs included).
torch runs on one thread by default: on 2 shared cores, two torch threads wait on each
other whenever the other core is taken, and step times become both slower and erratic
(decode of 4 requests: ~110 ms on one thread, 0.6-1.3 s on two, measured under load).
Writes fidelity.csv, fidelity.json, calibration.json, real.json (the measured metrics of every
repeat) and each real repeat's steps csv to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis.metrics import summarize
from engine.config import EngineConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.executor.inprocess import InProcessExecutor
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from engine.sim.model_counts import load_arch
from workloads.calibration import fit_step_model
from workloads.simulate import Clock, SimResult, WallClock, replay, simulate, trace_token_specs
from workloads.spec import RequestSpec
from workloads.traces import TraceRow, load_trace, scale_time, slice_rows

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
MODEL = "smollm2"
# The default step model for this CPU (see docs/capacity.md): the cost of a step's tokens (one
# pass of the weights' GEMMs over them) as an interpolated table in num_tokens (it jumps with
# the CPU's blocked kernels, and falls where a faster kernel takes over: not monotone), linear
# per-request, KV-read, mixed-step and prefill-squared terms, fitted with Huber weights.
DEFAULT_TABLES = "num_tokens=auto"
DEFAULT_FEATURES = "num_prefill_reqs,num_decode_reqs,num_kv_tokens_read,is_mixed,num_prefill_tokens_sq"
METRICS = (("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("output_throughput", "out tok/s"))


def parse_runs(text: str) -> list[tuple[float, int]]:
    """'0.25:128,0.6:512' -> [(0.25, 128), (0.6, 512)] (rate req/s : budget tokens)."""
    out = []
    for part in text.split(","):
        rate, budget = part.split(":")
        out.append((float(rate), int(budget)))
    return out


def scaled_rows(trace: Path, n: int, start_s: float, length_scale: float) -> list[TraceRow]:
    rows, _ = load_trace(trace)
    rows = slice_rows(rows, first_n=n, start_s=start_s)
    return [
        replace(r, prompt_tokens=max(1, round(r.prompt_tokens * length_scale)),
                output_tokens=max(2, round(r.output_tokens * length_scale)))
        for r in rows
    ]  # fmt: skip


def specs_at_rate(rows: list[TraceRow], rate: float, vocab_size: int, tag: str) -> list[RequestSpec]:
    """The slice's arrivals rescaled to a mean of `rate` requests/s (shape of the trace kept)."""
    span = rows[-1].timestamp_s - rows[0].timestamp_s
    natural = (len(rows) - 1) / span if span > 0 else rate
    return trace_token_specs(scale_time(rows, rate / natural), vocab_size, id_prefix=tag)


def summary_of(res: SimResult) -> dict[str, float]:
    s = summarize(res.records, steps=res.steps_frame())
    return {k: s[k] for k, _ in METRICS} | {"num_steps": s["num_steps"], "completed": s["completed"]}


class CpuClock:
    """This process's CPU time plus the idle gaps it jumped: a core of our own, uncontended.

    While the engine works, time advances with `time.process_time()` (all threads: run torch
    on one thread); `advance_to(t)` jumps an idle engine forward to the next arrival.
    """

    def __init__(self) -> None:
        self._offset = time.time() - time.process_time()

    def clock(self) -> float:
        return self._offset + time.process_time()

    def advance_to(self, t: float) -> None:
        now = self.clock()
        if t > now:
            self._offset += t - now


class ClockedExecutor(InProcessExecutor):
    """The real in-process executor, its timestamps taken from `clock` (the engine's clock)."""

    def __init__(self, config: EngineConfig, clock: Clock) -> None:
        super().__init__(config)
        self._clock = clock

    def clock(self) -> float:
        return self._clock.clock()


def real_run(core: EngineCore, clock: Clock, specs: list[RequestSpec]) -> SimResult:
    """Replay on the real engine; then one more step hands the last finished ids to the model
    runner (they travel with the next SchedulerOutput), so `reconfigure` starts from an empty batch."""
    res = replay(core, clock, specs)
    if core.scheduler.finished_req_ids:
        core.step()
    return res


def warm_up(core: EngineCore, clock: Clock, vocab: int) -> None:
    """A few prefill and decode shapes first, so the measured runs see a warm model."""
    rows = [TraceRow(timestamp_s=0.0, prompt_tokens=n, output_tokens=4) for n in (16, 64, 200, 32)]
    real_run(core, clock, trace_token_specs(rows, vocab, id_prefix="warm"))


def parse_tables(text: str) -> dict[str, list[float]]:
    """'num_decode_reqs=auto;num_tokens=8,16' -> tables to fit (knots, or [] for automatic)."""
    out: dict[str, list[float]] = {}
    for part in filter(None, text.split(";")):
        name, _, knots = part.partition("=")
        out[name.strip()] = [] if knots.strip() in ("", "auto") else [float(k) for k in knots.split(",")]
    return out


def fit_model(steps: pd.DataFrame, args: argparse.Namespace) -> CalibratedStepModel:
    """The step model of `--fit`: `linear` (the plain NNLS fit) or `table` (piecewise-linear cost tables)."""
    if args.fit == "linear":
        return fit_step_model(steps, robust=args.robust)
    features = args.features.split(",") if args.features else None
    return fit_step_model(
        steps, features=features, tables=parse_tables(args.tables), robust=args.robust, monotone=args.monotone
    )


def median_summary(reps: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the median over the repeats of a run (the mean of the middle two for an even count)."""
    return {k: float(np.median([r[k] for r in reps])) for k in reps[0]}


def measure(
    args: argparse.Namespace, rows: list[TraceRow], plan: list[tuple[str, float, int]]
) -> tuple[list[dict], int]:
    """Every run of `plan` on the real engine, `--repeats` times (round-robin, so slow drift of the
    machine spreads over all runs); writes each repeat's steps csv and `real.json`."""
    arch = load_arch(MODEL)
    t_load = time.perf_counter()
    cfg = EngineConfig.from_kwargs(MODEL, max_num_batched_tokens=max(b for _, _, b in plan),
                                   max_num_seqs=args.max_num_seqs)  # fmt: skip
    clock: Clock = CpuClock() if args.clock == "cpu" else WallClock()
    core = EngineCore(cfg, executor=ClockedExecutor(cfg, clock))
    warm_up(core, clock, arch.vocab_size)
    print(f"model loaded and warm in {time.perf_counter() - t_load:.1f} s, {core.num_blocks} KV blocks")
    runs = [{"kind": k, "rate": rate, "budget": b, "reps": [], "steps_csv": []} for k, rate, b in plan]
    for rep in range(args.repeats):
        for r in runs:
            sched = SchedulerConfig(max_num_batched_tokens=r["budget"], max_num_seqs=args.max_num_seqs)
            core.reconfigure(scheduler_config=sched)
            specs = specs_at_rate(rows, r["rate"], arch.vocab_size, f"r{r['rate']}-b{r['budget']}-{rep}")
            t0 = time.perf_counter()
            res = real_run(core, clock, specs)
            steps = res.steps_frame()
            name = f"steps_rate{r['rate']}_budget{r['budget']}_rep{rep}.csv"
            steps.to_csv(args.out / name, index=False)
            r["reps"].append(summary_of(res))
            r["steps_csv"].append(name)
            m = r["reps"][-1]
            print(f"  real {r['kind']:<11} rate {r['rate']:<5} budget {r['budget']:<4} rep {rep}: "
                  f"{time.perf_counter() - t0:5.1f} s, {len(steps)} steps, TTFT {m['mean_ttft_ms']:.0f} ms, "
                  f"TPOT {m['mean_tpot_ms']:.0f} ms, {m['output_throughput']:.1f} tok/s")  # fmt: skip
    (args.out / "real.json").write_text(json.dumps(
        {"num_blocks": core.num_blocks, "clock": args.clock, "threads": args.threads, "runs": runs}, indent=2))  # fmt: skip
    return runs, core.num_blocks


def evaluate(model: CalibratedStepModel, runs: list[dict], rows: list[TraceRow], num_blocks: int,
             max_num_seqs: int) -> pd.DataFrame:  # fmt: skip
    """Simulate every run with `model` (same specs, KV blocks and scheduler config); measured = median of repeats."""
    arch = load_arch(MODEL)
    table = []
    for r in runs:
        scfg = EngineConfig.from_kwargs(MODEL, max_num_batched_tokens=r["budget"], max_num_seqs=max_num_seqs)
        scfg.cache.num_blocks = num_blocks
        specs = specs_at_rate(rows, r["rate"], arch.vocab_size, f"r{r['rate']}-b{r['budget']}")
        pred = summary_of(simulate(specs, scfg, SimulatedExecutor(scfg, model, arch)))
        measured = median_summary(r["reps"])
        row: dict = {"set": r["kind"], "rate": r["rate"], "budget": r["budget"], "repeats": len(r["reps"])}
        for key, _ in METRICS:
            m, p = measured[key], pred[key]
            row[f"{key}_measured"], row[f"{key}_predicted"] = m, p
            row[f"{key}_err_pct"] = 100.0 * (p - m) / m if m else float("nan")
            vals = [x[key] for x in r["reps"]]
            row[f"{key}_spread_pct"] = 100.0 * (max(vals) - min(vals)) / m if m else float("nan")
        row["steps_measured"], row["steps_predicted"] = measured["num_steps"], pred["num_steps"]
        table.append(row)
    return pd.DataFrame(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--start-s", type=float, default=0.0, help="trace slice start (s)")
    ap.add_argument("--length-scale", type=float, default=0.125)
    ap.add_argument("--calibrate", default="1.0:128,3.0:512", help="rate:budget,... of the calibration runs")
    ap.add_argument("--holdout", default="2.0:256,4.0:64,1.5:64", help="rate:budget,... of the held-out runs")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="how real runs are timed")
    ap.add_argument("--repeats", type=int, default=2, help="real repeats of each run (metrics: median)")
    ap.add_argument("--fit", choices=("table", "linear"), default="table", help="step model to fit")
    ap.add_argument("--tables", default=DEFAULT_TABLES, help="--fit table: feature=knots;... ('auto' knots)")
    ap.add_argument(
        "--features", default=DEFAULT_FEATURES, help="--fit table: linear features (comma-separated)"
    )
    ap.add_argument("--robust", action=argparse.BooleanOptionalAction, default=True,
                    help="Huber-weighted fit (outlier steps count less)")  # fmt: skip
    ap.add_argument("--monotone", action=argparse.BooleanOptionalAction, default=False,
                    help="--fit table: tables never decrease (default: they follow the data down)")  # fmt: skip
    ap.add_argument("--reuse", type=Path, default=None,
                    help="a previous --out: refit and re-simulate its real runs (real.json, steps csvs)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sim_fidelity")
    args = ap.parse_args()
    if not args.trace.is_file():
        raise SystemExit(f"error: trace not found: {args.trace}")
    try:
        calib, hold = parse_runs(args.calibrate), parse_runs(args.holdout)
    except ValueError:
        raise SystemExit(
            "error: --calibrate/--holdout take rate:budget pairs, e.g. 0.3:128,0.6:512"
        ) from None
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    rows = scaled_rows(args.trace, args.num_requests, args.start_s, args.length_scale)
    print(f"slice: {len(rows)} requests, mean prompt {sum(r.prompt_tokens for r in rows) / len(rows):.0f}, "
          f"mean output {sum(r.output_tokens for r in rows) / len(rows):.0f} tokens")  # fmt: skip
    src, clock_name = args.out, args.clock
    if args.reuse is not None:
        real = json.loads((args.reuse / "real.json").read_text())
        runs, num_blocks, src, clock_name = real["runs"], real["num_blocks"], args.reuse, real["clock"]
        kinds = {(r["rate"], r["budget"]): r for r in runs}
        runs = [kinds[p] | {"kind": "calibration"} for p in calib] + [
            kinds[p] | {"kind": "held-out"} for p in hold
        ]
    else:
        plan = [("calibration", r, b) for r, b in calib] + [("held-out", r, b) for r, b in hold]
        runs, num_blocks = measure(args, rows, plan)

    fit_df = pd.concat([pd.read_csv(src / name) for r in runs if r["kind"] == "calibration"
                        for name in r["steps_csv"]], ignore_index=True)  # fmt: skip
    model = fit_model(fit_df, args)
    model.meta = {
        "model": MODEL,
        "clock": clock_name,
        "runs": [f"{r['rate']}:{r['budget']}" for r in runs if r["kind"] == "calibration"],
        "repeats": max(len(r["reps"]) for r in runs),
    }
    model.save(args.out / "calibration.json")
    print(f"calibration: {model.describe()}")
    df = evaluate(model, runs, rows, num_blocks, args.max_num_seqs)
    df.to_csv(args.out / "fidelity.csv", index=False)
    (args.out / "fidelity.json").write_text(
        json.dumps({"calibration": model.to_dict(), "runs": df.to_dict(orient="records")}, indent=2)
    )
    print_table(df)
    if args.fit != "linear":
        base = evaluate(fit_step_model(fit_df), runs, rows, num_blocks, args.max_num_seqs)
        held = base[base["set"] == "held-out"]
        worst = max(held[f"{k}_err_pct"].abs().max() for k, _ in METRICS) if len(held) else float("nan")
        print(f"(for comparison, the plain linear fit: held-out worst |error| {worst:.1f}%)")


def print_table(df: pd.DataFrame) -> None:
    head = f"{'set':<11} {'rate':>5} {'budget':>6} |"
    for _, label in METRICS:
        head += f" {label + ' meas':>15} {'pred':>8} {'err':>7} |"
    print(head)
    print("-" * len(head))
    for _, r in df.iterrows():
        line = f"{r['set']:<11} {r['rate']:>5} {r['budget']:>6} |"
        for key, _ in METRICS:
            line += f" {r[key + '_measured']:>15.1f} {r[key + '_predicted']:>8.1f} {r[key + '_err_pct']:>+6.1f}% |"
        spread = max(r[key + "_spread_pct"] for key, _ in METRICS)
        print(line + (f" repeats differ by up to {spread:.0f}%" if r["repeats"] > 1 else ""))
    held = df[df["set"] == "held-out"]
    if len(held):
        worst = max(held[f"{k}_err_pct"].abs().max() for k, _ in METRICS)
        print(f"held-out worst |error|: {worst:.1f}% (acceptance: 15%)")


if __name__ == "__main__":
    main()
