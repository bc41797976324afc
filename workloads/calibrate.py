"""`servelab-calibrate RUN_DIR... --out PATH`: a step-time model fitted from any workbench runs.

    servelab-calibrate runs/default/2026* --out ~/.servelab/profiles/my-cpu.yaml
    servelab-plan --step-model ~/.servelab/profiles/my-cpu.yaml --hardware cpu-2core ...

Reads the engine steps (steps.csv with `step_time`: in-process and offline runs; HTTP runs
only have scraped gauges and are skipped, with the reason printed) of every run folder given,
fits `workloads.calibration.fit_step_model` on the calibration steps and reports fidelity on
held-out steps: whole runs held out when there are several (every `--holdout-every`-th run),
else a seeded 25% of the steps. Fidelity = median and p90 absolute relative error per step,
and the error of the held-out steps' total time (what a simulated run's duration depends on).

The profile (PATH, YAML or `.json`) is a calibrated step model (`kind: calibrated`) with what it
was fitted from in `meta` (runs, model, dtype, held-out fidelity); `sim.step_model=PATH` (or
servelab-plan's `--step-model PATH`) uses it for simulated runs and plans. The model is fitted
on the full set after the held-out check, so no step is wasted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from engine.sim.calibrated import CalibratedStepModel
from workloads.calibration import fit_step_model


class CalibrationError(ValueError):
    """Nothing to fit, or a bad argument; the message is one line."""


def load_steps(run_dirs: list[Path]) -> tuple[list[tuple[Path, pd.DataFrame]], list[str]]:
    """(run, steps with step_time) per usable run, and one line per skipped run."""
    usable, skipped = [], []
    for run in run_dirs:
        path = run / "steps.csv"
        if not path.is_file():
            skipped.append(f"{run}: no steps.csv")
            continue
        df = pd.read_csv(path)
        if "step_time" not in df or "num_prefill_tokens" not in df:
            skipped.append(f"{run}: steps.csv has no engine step times (an HTTP target's scraped gauges)")
            continue
        df = df[(df["num_prefill_tokens"] + df["num_decode_tokens"]) > 0]
        if df.empty:
            skipped.append(f"{run}: no step with scheduled tokens")
            continue
        usable.append((run, df))
    return usable, skipped


def fidelity(model: CalibratedStepModel, steps: pd.DataFrame) -> dict[str, float]:
    """Per-step relative error of `model` on `steps` and the error of their total time."""
    pred = np.array([model.step_time(row) for row in _batches(steps)])
    real = steps["step_time"].to_numpy(dtype=float)
    rel = np.abs(pred - real) / np.maximum(real, 1e-9)
    return {"steps": int(len(real)), "median_abs_rel_error": float(np.median(rel)),
            "p90_abs_rel_error": float(np.percentile(rel, 90)),
            "total_time_rel_error": float((pred.sum() - real.sum()) / real.sum())}


def _batches(steps: pd.DataFrame) -> list[Any]:
    """steps.csv rows as the simulator's `StepBatch` (the fields the step model reads)."""
    from engine.sim.step_batch import StepBatch

    out = []
    for r in steps.to_dict("records"):
        prefill, decode = int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])
        reqs = int(r.get("num_prefill_reqs", 0)) + int(r.get("num_decode_reqs", 0))
        out.append(StepBatch(num_tokens=prefill + decode, num_reqs=reqs, num_sampled=reqs,
                             num_prefill_tokens=prefill, num_decode_tokens=decode,
                             num_decode_reqs=int(r.get("num_decode_reqs", 0)),
                             kv_tokens_read=int(r.get("num_kv_tokens_read", 0) or 0),
                             kv_blocks=int(r.get("kv_blocks_used", 0) or 0)))
    return out


def split(usable: list[tuple[Path, pd.DataFrame]], every: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(calibration steps, held-out steps, how they were split)."""
    if len(usable) >= 2:
        held = [i for i in range(len(usable)) if i % every == every - 1] or [len(usable) - 1]
        cal = pd.concat([df for i, (_, df) in enumerate(usable) if i not in held])
        out = pd.concat([df for i, (_, df) in enumerate(usable) if i in held])
        return cal, out, "held-out runs: " + ", ".join(str(usable[i][0]) for i in held)
    df = usable[0][1]
    mask = np.random.default_rng(seed).random(len(df)) < 0.25
    if mask.all() or not mask.any():
        raise CalibrationError("too few steps to hold any out (one run with fewer than ~8 steps)")
    return df[~mask], df[mask], "held-out: a seeded 25% of the steps of the one run"


def calibrate(run_dirs: list[Path], out: Path, *, every: int = 4, robust: bool = True, seed: int = 0,
              tables: list[str] | None = None) -> dict[str, Any]:
    usable, skipped = load_steps(run_dirs)
    for line in skipped:
        print(f"servelab-calibrate: skipped {line}", file=sys.stderr)
    if not usable:
        raise CalibrationError("no run folder with engine steps (steps.csv with step_time) among the ones given")
    knots = {name: [] for name in tables or []}
    cal, held, how = split(usable, every, seed)
    try:
        check = fit_step_model(cal, tables=knots, robust=robust)
        held_fidelity = fidelity(check, held)
        model = fit_step_model(pd.concat([df for _, df in usable]), tables=knots, robust=robust)
    except ValueError as exc:
        raise CalibrationError(f"fit failed: {exc}") from None
    model.meta = {"fitted_from": [str(r) for r, _ in usable], **_run_identity(usable[0][0]),
                  "held_out": {"split": how, **held_fidelity}}
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    return {"model": model, "held_out": held_fidelity, "split": how, "skipped": skipped}


def _run_identity(run: Path) -> dict[str, Any]:
    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    model = (cfg or {}).get("model") or {}
    return {"model": model.get("model"), "dtype": model.get("dtype")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="servelab-calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="workbench run folders (steps.csv with engine step times)")
    p.add_argument("--out", required=True, help="where to write the profile (.yaml or .json)")
    p.add_argument("--holdout-every", type=int, default=4, help="hold out every k-th run (default 4; >= 2)")
    p.add_argument("--table", action="append", default=[],
                   help="fit this feature as a piecewise-linear table (e.g. num_decode_reqs); repeatable")
    p.add_argument("--plain-fit", action="store_true", help="ordinary least squares instead of robust (Huber)")
    args = p.parse_args(argv)
    if args.holdout_every < 2:
        print("servelab-calibrate: --holdout-every must be at least 2", file=sys.stderr)
        sys.exit(2)
    try:
        res = calibrate([Path(d).expanduser() for d in args.run_dirs], Path(args.out).expanduser(),
                        every=args.holdout_every, robust=not args.plain_fit, tables=args.table)
    except (CalibrationError, OSError) as exc:
        print(f"servelab-calibrate: {exc}", file=sys.stderr)
        sys.exit(2)
    h = res["held_out"]
    print(f"model: {res['model'].describe()}")
    print(f"held-out fidelity ({res['split']}; {h['steps']} steps): median |error| {h['median_abs_rel_error']:.1%}, "
          f"p90 {h['p90_abs_rel_error']:.1%}, total time {h['total_time_rel_error']:+.1%}")
    print(f"profile: {args.out}  (use: servelab-plan --step-model {args.out}, or sim.step_model={args.out})")


if __name__ == "__main__":
    main()
