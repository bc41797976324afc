"""`servelab-run` end to end on the default model, as a user runs it (a subprocess per command).

- a 2x2 sweep (token budget x prefix caching) writes sweep.csv with one row per job;
- the in-process and the servelab-serve targets give the same token counts per request;
- profiling on: a Chrome trace with the engine's phase ranges, a kernel table joined to steps,
  and a report that says there is no GPU telemetry on a CPU machine;
- the gate: an identical rerun passes, a run slowed by `scheduler.step_delay_ms` fails and
  names the time metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GATE = str(Path(sys.executable).parent / "servelab-gate")
TINY = [
    "workload=fixed",
    "workload.num_requests=4",
    "workload.warmup_requests=0",
    "workload.prompt_len.value=24",
    "workload.output_len.value=6",
    "run.time_reference=false",
    "cache.num_blocks=64",  # these runs use a few blocks; the default 1 GiB takes ~1 s to fault in
]

# a 1-layer dummy-weight model where a check counts tokens, rows or cache hits, not model output
SMALL_MODEL = ["model.load_format=dummy", "model.num_layers_override=1"]


def servelab_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.cli", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_once(run_dir: Path, *overrides: str, report: bool = True) -> Path:
    """One `servelab-run`; `report=False` skips the HTML page (~4 s of figures on 2 cores) where
    the test reads only the run folder's tables."""
    proc = servelab_run(*overrides, f"report.html={str(report).lower()}", f"hydra.run.dir={run_dir}")
    assert f"run folder: {run_dir}" in proc.stdout
    assert (run_dir / "report.html").exists() == report and not (run_dir / "error.txt").exists()
    return run_dir


def runs_side_by_side(*runs: tuple[Path, list[str]], timeout: float = 300) -> None:
    """`run_once` for each (run folder, overrides) without the HTML page, the processes started
    together: for runs whose figures are compared by count, not by time (each mostly waits on its
    own start-up)."""
    procs = [(run_dir, subprocess.Popen([sys.executable, "-m", "workloads.cli", *overrides, "report.html=false",
                                         f"hydra.run.dir={run_dir}"],
                                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for run_dir, overrides in runs]  # fmt: skip
    for run_dir, proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        assert f"run folder: {run_dir}" in out
        assert (run_dir / "summary.json").exists() and not (run_dir / "error.txt").exists()


def test_sweep_2x2_writes_sweep_csv(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    servelab_run(
        "sweep=budgets_prefix", "workload=shared_prefix", "workload.num_requests=4",
        "workload.warmup_requests=0", "workload.prompt_len.low=40", "workload.prompt_len.high=60",
        "workload.shared_prefix.prefix_len=48", "workload.shared_prefix.num_groups=1",
        "workload.shared_prefix.fraction=1.0", "workload.output_len.value=4",
        "workload.arrival.rate=16", "run.time_reference=false", "cache.num_blocks=64",
        *SMALL_MODEL,  # the sweep's rows, counts and hit rates do not depend on the weights
        "report.html=false",  # the jobs' pages; the sweep's own page is written regardless
        f"hydra.sweep.dir={sweep_dir}", timeout=600,
    )
    df = pd.read_csv(sweep_dir / "sweep.csv")
    assert len(df) == 4
    combos = set(zip(df["scheduler.max_num_batched_tokens"], df["cache.enable_prefix_caching"], strict=True))
    assert combos == {(256, True), (256, False), (1024, True), (1024, False)}
    assert (df["completed"] == 4).all() and (df["failed"] == 0).all()
    # prefix caching off never hits; on, the shared system prompts do
    off = df[~df["cache.enable_prefix_caching"].astype(bool)]
    on = df[df["cache.enable_prefix_caching"].astype(bool)]
    assert (off["prefix_cache_hit_rate"].fillna(0) == 0).all() and (on["prefix_cache_hit_rate"] > 0).all()
    assert any(p.suffix == ".html" for p in sweep_dir.iterdir())


def test_enforce_eager_sweep_records_compile_status(tmp_path: Path) -> None:
    """`-m model.enforce_eager=true,false`: the compiled job's steps ran compiled and its summary
    has the start-up compile time; the eager job's did not (1-layer dummy model: short compile)."""
    sweep_dir = tmp_path / "sweep"
    servelab_run(
        "-m", "model.enforce_eager=true,false", "model.load_format=dummy", "model.num_layers_override=1",
        *TINY, "report.html=false", f"hydra.sweep.dir={sweep_dir}", timeout=900,
    )
    df = pd.read_csv(sweep_dir / "sweep.csv")
    assert sorted(df["model.enforce_eager"].astype(bool)) == [False, True]
    assert (df["completed"] == 4).all()
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / "steps.csv").exists()):
        eager = yaml.safe_load((job / "config.yaml").read_text())["model"]["enforce_eager"]
        steps = pd.read_csv(job / "steps.csv")
        worked = steps[steps["num_prefill_tokens"] + steps["num_decode_tokens"] > 0]
        summary = json.loads((job / "summary.json").read_text())
        assert (worked["compiled"].astype(bool) == (not eager)).all()
        assert (worked["padded_tokens"] >= worked["num_prefill_tokens"] + worked["num_decode_tokens"]).all()
        assert (summary["compile_time_s"] > 0) == (not eager)


def test_inprocess_and_server_targets_give_the_same_token_counts(tmp_path: Path) -> None:
    workload = [*TINY, *SMALL_MODEL, "workload.output_len.value=12", "workload.num_requests=5"]
    a, b = tmp_path / "inprocess", tmp_path / "server"
    runs_side_by_side((a, [*workload, "target=inprocess"]), (b, [*workload, "target=server"]))
    ra = pd.read_csv(a / "requests.csv").set_index("request_id").sort_index()
    rb = pd.read_csv(b / "requests.csv").set_index("request_id").sort_index()
    assert list(ra.index) == list(rb.index) and len(ra) == 5
    assert ra["prompt_tokens"].tolist() == rb["prompt_tokens"].tolist()
    assert ra["output_tokens"].tolist() == rb["output_tokens"].tolist()
    assert (ra["output_tokens"] > 0).all()


def test_profiled_run_trace_kernel_table_and_report(tmp_path: Path) -> None:
    run = run_once(
        tmp_path / "prof", *TINY, "profiling=enabled", "profiling.wait=2", "profiling.active=3",
        "profiling.telemetry_interval_s=0.2",
    )
    trace = json.loads((run / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    for phase in ("schedule", "prepare_inputs", "forward", "sample", "update"):
        assert any(n.startswith(f"servelab::{phase}#step=") for n in names), (phase, sorted(names)[:30])
    kernels = pd.read_csv(run / "kernels.csv")
    steps = pd.read_csv(run / "steps.csv")
    assert set(kernels["step"]) <= set(steps["step"]) and len(set(kernels["step"])) == 3
    assert {"gemm", "attention", "host"} <= set(kernels["category"])
    # the kernel table accounts for the forward time of every profiled step (within 5%)
    from profiling.kernel_table import kernel_table, phase_durations

    table, ranges = kernel_table(trace["traceEvents"]), phase_durations(trace["traceEvents"])
    for step in set(kernels["step"]):
        fwd = ranges[(ranges["step"] == step) & (ranges["phase"] == "forward")]["duration_ms"].sum()
        in_fwd = table[(table["step"] == step) & (table["phase"] == "forward")]
        assert in_fwd["time_ms"].sum() == pytest.approx(fwd, rel=0.05)
        ops = in_fwd[in_fwd["category"] != "host"]
        assert ops.groupby("category")["time_ms"].sum().idxmax() == "gemm"  # the model is GEMM-bound
    html = (run / "report.html").read_text()
    assert "no GPU telemetry" in html


def _gate(baseline: Path, run: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE, "--baseline", str(baseline), "--config", str(config),
         str(run)], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def test_gate_passes_a_rerun_and_fails_a_slowed_run(tmp_path: Path) -> None:
    # two layers of the real model: the verdicts, not the model, are under test (as in conf/gate/paired.yaml)
    gate_overrides = ["experiment=ci_gate", "run.time_reference=true", "model.num_layers_override=2"]
    base = run_once(tmp_path / "base", *gate_overrides, report=False)
    rerun = run_once(tmp_path / "rerun", *gate_overrides, report=False)
    # A delay per step of twice the normal step time (at least 60 ms) makes every step ~3x
    # slower, whatever the speed of this machine.
    step_ms = pd.read_csv(base / "steps.csv")["step_time"].mean() * 1000
    delay = max(60, round(2 * step_ms))
    slow = run_once(tmp_path / "slow", *gate_overrides, f"scheduler.step_delay_ms={delay}", report=False)

    # conf/gate/ci.yaml: time metrics may be 60% worse before they fail (CI machines differ).
    config = yaml.safe_load((ROOT / "conf" / "gate" / "ci.yaml").read_text())
    cfg_path = tmp_path / "gate.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    baseline = tmp_path / "baseline.json"
    made = subprocess.run(
        [GATE, "--make-baseline", str(baseline), str(base)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert made.returncode == 0, made.stderr

    ok = _gate(baseline, rerun, cfg_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads((rerun / "gate.json").read_text())["verdict"] == "pass"

    bad = _gate(baseline, slow, cfg_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    regressed = {line.split(":")[0].split()[-1] for line in bad.stdout.splitlines()
                 if line.startswith("REGRESSION")}
    assert {"mean_e2el_ms", "output_throughput"} <= regressed, bad.stdout
    # machine-independent metrics are unchanged by a slower machine
    assert not regressed & {"num_steps", "mean_tokens_per_step", "prefix_cache_hit_rate", "num_preemptions"}
