"""The GPU readiness check: every GPU path of servelab in one time-boxed run (issue 12).

    bash scripts/gpu_check.sh [--dry-run] [--python PY] [--out DIR] [--export DIR] [--budget-s 470]
    python benchmarks/gpu_check.py ...   # the same, without the shell wrapper's defaults

Steps, in order; each runs in its own process under a time box, and a step that fails or
times out never stops the ones after it:

  setup              the CUDA environment: a set-up venv (.venv) if it sees the GPU, else
                     scripts/setup.sh when a package index answers, else the machine's own
                     python3 with its CUDA torch; wheels carried in .whl/ are installed beside it
  flash_libs         FlashAttention / FlashInfer from binary wheels only (no source builds)
  gpu_tests          `pytest -m gpu`: Triton kernels compiled vs the torch reference, every
                     attention backend over paged caches (chunked prefill, prefix hit), the
                     engine on the GPU, sampler options on device, CUDA graphs vs eager, NVML
  attention_kernels  benchmarks/attention_kernels.py: decode GB/s vs the device peak, prefill
                     TFLOP/s, Triton vs SDPA / FlashAttention / FlashInfer
  offline_8b         benchmarks/gpu_offline.py: Llama-3-8B shape, dummy bf16 weights: batch-1
                     decode step vs the weight-read time, batch 64 / 256 throughput
  profiled_run       `servelab-run profiling=enabled` on the 8B shape with NVML telemetry: a
                     report with GPU kernel timelines

Every figure goes to <out>/gpu_check.json and a short table to <out>/gpu_check.txt (also
printed). `--dry-run` (chosen automatically by scripts/gpu_check.sh where no GPU is found)
runs nothing on a GPU: it lists each step and checks that every script and test it names
exists and imports, and that the GPU tests collect. Exit status: 0 when every step passed
(or was skipped with its reason), 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 470.0  # the whole check stays under 8 minutes
MIN_STEP_S = 10.0  # a step is not started with less time left than this
GPU_TEST_FILES = ["test_gpu.py", "test_triton_kernels.py", "test_triton_backend.py", "test_sampler_device.py"]
BENCH_SCRIPTS = ["benchmarks/attention_kernels.py", "benchmarks/gpu_offline.py"]
# Modules the engine, the workbench and the GPU tests import (a missing one is named, not fatal).
ENGINE_MODULES = [
    "torch", "triton", "numpy", "msgspec", "zmq", "gguf", "tokenizers", "hydra", "omegaconf", "pydantic",
    "pandas", "matplotlib", "jinja2", "pynvml", "psutil", "pytest",
    "engine.frontend.llm", "engine.attention.triton_backend", "engine.sample.sampler", "profiling.telemetry",
    "profiling.torch_profiler", "workloads.cli",
]  # fmt: skip
FLASH_PACKAGES = {"flash_attn": "flash-attn", "flashinfer": "flashinfer-python"}
PROFILED_RUN_OVERRIDES = [
    "profiling=enabled", "model=llama-3-8b", "model.load_format=dummy", "model.dtype=bfloat16",
    "attention=triton", "device.device=cuda", "target=offline", "workload.num_requests=24",
    "workload.warmup_requests=2", "scheduler.max_num_seqs=32", "cache.kv_cache_memory_gb=8",
]  # fmt: skip
PIP_QUICK = ["--timeout", "5", "--retries", "0", "--disable-pip-version-check", "-q"]


@dataclass
class StepResult:
    name: str
    title: str
    status: str = "pending"  # ok | failed | timeout | skipped | error
    seconds: float = 0.0
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class Context:
    out: Path
    dry_run: bool
    deadline: float
    python: str  # the interpreter the steps run (chosen by `setup`)
    python_given: bool  # --python was passed: setup uses it as it is
    env: dict[str, str]
    site: Path | None = None  # where carried wheels were installed (on PYTHONPATH)
    results: dict[str, StepResult] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], box_s: float, **kw: Any) -> tuple[int | None, str]:
        """Run cmd in its own process group under min(box_s, time left); (rc or None on timeout, output).

        The output also goes to <out>/logs/<name>.log.
        """
        limit = max(1.0, min(box_s, self.remaining()))
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as fh:
            fh.write(f"$ {' '.join(cmd)}   (limit {limit:.0f} s)\n")
            fh.flush()
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True, **kw,
            )  # fmt: skip
            try:
                text, _ = proc.communicate(timeout=limit)
                rc: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the step and every child it started
                text, _ = proc.communicate()
                rc = None
            fh.write(text or "")
            fh.write(f"\n[exit: {'timeout' if rc is None else rc}]\n")
        return rc, text or ""

    def py(self, *args: str) -> list[str]:
        return [self.python, *args]


def tail(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[:300]


# ---- step 1: the CUDA environment ------------------------------------------------------------
def probe_python(ctx: Context, python: str) -> dict[str, Any] | None:
    """torch / CUDA facts of an interpreter, or None if it has no torch."""
    code = (
        "import json, torch; d = {'torch': torch.__version__, 'cuda': torch.cuda.is_available(), "
        "'cuda_version': torch.version.cuda}; "
        "d['device'] = torch.cuda.get_device_name() if d['cuda'] else None; print(json.dumps(d))"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, env=ctx.env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def index_reachable(ctx: Context, python: str) -> bool:
    """Whether pip reaches a package index (downloads pip's own small wheel; a few seconds offline)."""
    tmp = ctx.out / "pip-probe"
    rc, _ = ctx.run(
        "setup", [python, "-m", "pip", "download", "--no-deps", *PIP_QUICK, "-d", str(tmp), "pip"], 30
    )
    shutil.rmtree(tmp, ignore_errors=True)
    return rc == 0


def install_carried_wheels(ctx: Context, r: StepResult) -> None:
    """Install .whl/*.whl into <out>/site (on PYTHONPATH); one wheel that does not fit skips only itself."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        r.notes.append("no carried wheels in .whl/ (scripts/gpu_check.sh --fetch-wheels makes them)")
        return
    site = ctx.out / "site"
    pip = [ctx.python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--upgrade", "-q",
           "--target", str(site)]  # fmt: skip
    rc, _ = ctx.run("setup", [*pip, *map(str, wheels)], 90)
    failed = []
    if rc != 0:  # one at a time, so that the others still install
        failed = [w.name for w in wheels if ctx.run("setup", [*pip, str(w)], 30)[0] != 0]
    if len(failed) < len(wheels):
        ctx.site = site
        ctx.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
    r.notes.append(f"installed {len(wheels) - len(failed)} of {len(wheels)} carried wheels into {site}")
    if failed:
        r.notes.append(f"wheels that do not fit this python: {', '.join(failed)}")


def missing_modules(ctx: Context) -> list[str]:
    code = (
        "import importlib, json, sys\nmissing = []\n"
        f"for m in {ENGINE_MODULES!r}:\n"
        "    try:\n        importlib.import_module(m)\n"
        "    except Exception as e:\n        missing.append(f'{m} ({type(e).__name__}: {e})'[:160])\n"
        "print(json.dumps(missing))"
    )
    rc, text = ctx.run("setup", ctx.py("-c", code), 120)
    if rc != 0:
        return [f"import check failed: {tail(text, 1)}"]
    return json.loads(text.strip().splitlines()[-1])


def step_setup(ctx: Context, r: StepResult) -> None:
    venv_py = str(ROOT / ".venv" / "bin" / "python")
    if ctx.dry_run:
        r.figures["python"] = ctx.python
        ok = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "setup.sh")]).returncode == 0
        r.notes.append(
            "would use: --python, else .venv if it sees the GPU, else scripts/setup.sh, else python3"
        )
        wheels = len(list((ROOT / ".whl").glob("*.whl")))
        r.notes.append(
            f"{wheels} carried wheels in .whl/" if wheels else "no .whl/ (--fetch-wheels makes it)"
        )
        missing = missing_modules(ctx)
        r.figures["missing_modules"] = missing
        r.status = "ok" if ok and not missing else "failed"
        r.summary = f"scripts/setup.sh {'parses' if ok else 'has a syntax error'}; " + (
            f"missing: {', '.join(missing)}" if missing else f"every module imports under {ctx.python}"
        )
        return
    # Order: --python as given; a set-up .venv that sees the GPU; scripts/setup.sh when a package
    # index answers; the machine's own python3 (a GPU image's CUDA torch).
    chosen, facts = ctx.python, probe_python(ctx, ctx.python) if ctx.python_given else None
    if not ctx.python_given and Path(venv_py).exists():
        facts, chosen = probe_python(ctx, venv_py), venv_py
    if not ctx.python_given and not (facts and facts["cuda"]):
        system = shutil.which("python3") or sys.executable
        if index_reachable(ctx, system):
            rc, text = ctx.run("setup", ["bash", "scripts/setup.sh", "--test"], 240)
            r.notes.append(f"scripts/setup.sh --test: {'ok' if rc == 0 else 'failed: ' + tail(text, 1)}")
            facts, chosen = probe_python(ctx, venv_py), venv_py
        else:
            r.notes.append("no package index reachable: scripts/setup.sh skipped")
        if not (facts and facts["cuda"]):
            facts, chosen = probe_python(ctx, system), system
            r.notes.append(f"using the machine's own {system}")
    ctx.python = chosen
    r.figures |= {"python": chosen, **(facts or {"torch": None, "cuda": False})}
    install_carried_wheels(ctx, r)
    missing = missing_modules(ctx)
    r.figures["missing_modules"] = missing
    cuda = bool(facts and facts["cuda"])
    r.status = "ok" if cuda and not missing else "failed"
    r.summary = f"{chosen}: torch {r.figures.get('torch')}, cuda {cuda} ({r.figures.get('device')})"
    if missing:
        r.summary += f"; missing: {', '.join(m.split(' ')[0] for m in missing)}"


def step_flash_libs(ctx: Context, r: StepResult) -> None:
    """Binary wheels only: a library whose wheel does not fit the installed torch is skipped, noted."""
    status = {}
    for module, package in FLASH_PACKAGES.items():
        if ctx.dry_run:
            status[module] = f"would try: pip install --only-binary=:all: {package}"
            continue
        rc, _ = ctx.run("flash_libs", ctx.py("-c", f"import {module}"), 60)
        if rc == 0:
            status[module] = "installed"
            continue
        target = ["--target", str(ctx.site)] if ctx.site is not None else []
        cmd = ctx.py("-m", "pip", "install", "--only-binary=:all:", "--no-deps", *PIP_QUICK, *target, package)
        rc, text = ctx.run("flash_libs", cmd, 60)
        if rc == 0 and ctx.run("flash_libs", ctx.py("-c", f"import {module}"), 60)[0] == 0:
            status[module] = "installed from a binary wheel"
        else:
            why = "no binary wheel for this torch / Python, or no package index"
            status[module] = (
                f"skipped: {why} ({tail(text, 1)[:120]})" if rc is not None else "skipped: timeout"
            )
    r.figures = status
    r.status = "ok"
    r.summary = "; ".join(f"{m}: {s.split(' (')[0]}" for m, s in status.items())


# ---- step 2: the GPU tests -------------------------------------------------------------------
def parse_junit(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skipped = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"  # tests.test_gpu::test_x
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            failed.append(f"{name}: {(node.get('message') or '')[:160]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            reason = (case.find("skipped").get("message") or "").removeprefix("Skipped: ")
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failed, "skip_reasons": skipped}


def gpu_test_files() -> list[str]:
    """Test files that use the `gpu` marker: only these are collected, so that a test module
    importing something the GPU machine lacks (the server tests' `openai`) cannot stop the run."""
    return sorted(
        f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text()
    )


def step_gpu_tests(ctx: Context, r: StepResult) -> None:
    files = [ROOT / "tests" / f for f in GPU_TEST_FILES]
    absent = [str(f.relative_to(ROOT)) for f in files if not f.is_file()]
    names = gpu_test_files()
    r.figures["files"] = names
    if ctx.dry_run:
        collect = ctx.py(
            "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *names
        )
        rc, text = ctx.run("gpu_tests", collect, 180)
        collected = [ln for ln in text.splitlines() if "::" in ln]
        missing_files = [
            f for f in GPU_TEST_FILES if not any(ln.startswith(f"tests/{f}::") for ln in collected)
        ]
        r.figures |= {"collected": len(collected), "files_without_tests": missing_files + absent}
        r.status = "ok" if rc == 0 and collected and not missing_files and not absent else "failed"
        r.summary = f"pytest -m gpu collects {len(collected)} tests in {len(names)} files"
        if r.status != "ok":
            r.summary += f"; collect rc {rc}; without tests: {missing_files + absent} {tail(text, 1)}"
        return
    xml = ctx.out / "gpu_tests.xml"
    # -v: one line per test, so a run stopped at its box still says which tests passed;
    # pytest-timeout stops a hung test (e.g. a kernel that never returns) after 90 s.
    cmd = ctx.py(
        "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider", "-o", "timeout=90",
        f"--junitxml={xml}", *names,
    )  # fmt: skip
    rc, text = ctx.run("gpu_tests", cmd, 150)
    res = parse_junit(xml) if xml.is_file() else parse_verbose(text)
    r.figures |= res
    r.status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    r.summary = f"{res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped"
    if rc is None:
        r.summary += " before the time box ended"
    if res["failures"]:
        r.summary += (
            " (failed: " + ", ".join(f.split("::")[1].split(":")[0] for f in res["failures"][:4]) + ")"
        )
    elif rc not in (0, None):
        r.summary += f"; pytest exit {rc}: {tail(text, 1)}"


def parse_verbose(text: str) -> dict[str, Any]:
    """Counts from `pytest -v` lines (`tests/x.py::test PASSED [ 5%]`) when no junit file was written."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M):
        outcome = m.group(2)
        if outcome in ("FAILED", "ERROR"):
            counts["failed"] += 1
            failed.append(f"{m.group(1).removeprefix('tests/')}: {outcome}")
        elif outcome in ("SKIPPED", "XFAIL"):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failed, "skip_reasons": {}}


# ---- step 3: benchmarks ----------------------------------------------------------------------
def import_check(ctx: Context, step: str, script: str, *extra: list[str]) -> tuple[bool, str]:
    """The script exists, imports as a module without running, and `--help` (or extra args) works."""
    path = ROOT / script
    if not path.is_file():
        return False, f"{script} is missing"
    code = (
        "import importlib.util, sys; sys.argv = ['x']; "
        f"spec = importlib.util.spec_from_file_location('bench', {str(path)!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)"
    )
    rc, text = ctx.run(step, ctx.py("-c", code), 120)
    if rc != 0:
        return False, f"{script} does not import: {tail(text, 1)}"
    for args in extra or (["--help"],):
        rc, text = ctx.run(step, ctx.py(script, *args), 120)
        if rc != 0:
            return False, f"{script} {' '.join(args)} failed: {tail(text, 1)}"
    return True, f"{script} imports and runs {' '.join(extra[0] if extra else ['--help'])}"


def summarize_attention(path: Path) -> dict[str, Any]:
    """Best decode bandwidth per implementation and prefill TFLOP/s per implementation."""
    rows = list(csv.DictReader(path.open()))
    out: dict[str, Any] = {"rows": rows, "decode_best": {}, "prefill_best": {}, "errors": {}}

    def num(x: str | None) -> float | None:
        try:
            return float(x) if x not in (None, "") else None
        except ValueError:
            return None

    for row in rows:
        impl, part, ms = row["impl"], row["part"], num(row.get("ms"))
        if ms is None:
            out["errors"][impl] = row.get("ms")
            continue
        if part == "decode" and num(row.get("GB/s")) is not None:
            best = out["decode_best"].get(impl)
            if best is None or num(row["GB/s"]) > best["GB/s"]:  # type: ignore[operator]
                out["decode_best"][impl] = {
                    "GB/s": num(row["GB/s"]), "frac_peak": num(row.get("frac_peak")),
                    "batch": row["batch"], "context": row["context"], "ms": ms,
                }  # fmt: skip
        if part == "prefill" and num(row.get("TFLOP/s")) is not None:
            best = out["prefill_best"].get(impl)
            if best is None or num(row["TFLOP/s"]) > best["TFLOP/s"]:  # type: ignore[operator]
                out["prefill_best"][impl] = {
                    "TFLOP/s": num(row["TFLOP/s"]),
                    "context": row["context"],
                    "ms": ms,
                }
    return out


def step_attention_kernels(ctx: Context, r: StepResult) -> None:
    script = "benchmarks/attention_kernels.py"
    if ctx.dry_run:
        ok, msg = import_check(ctx, "attention_kernels", script)
        r.status, r.summary = ("ok" if ok else "failed"), msg
        return
    csv_path = ctx.out / "attention_kernels.csv"
    args = ["--parts", "decode,prefill", "--batch-sizes", "1,16,64,256", "--context-lens", "1024,4096",
            "--iters", "10", "--out", str(csv_path)]  # fmt: skip
    rc, text = ctx.run("attention_kernels", ctx.py(script, *args), 90)
    if not csv_path.is_file():
        r.status, r.summary = ("timeout" if rc is None else "failed"), f"no CSV: {tail(text)}"
        return
    s = summarize_attention(csv_path)
    r.figures = s
    r.status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    parts = [f"decode {k}: {v['GB/s']:.0f} GB/s ({v['frac_peak']})" for k, v in s["decode_best"].items()]
    parts += [f"prefill {k}: {v['TFLOP/s']:.0f} TFLOP/s" for k, v in s["prefill_best"].items()]
    r.summary = "; ".join(parts) or "no timed rows"


def step_offline_8b(ctx: Context, r: StepResult) -> None:
    script = "benchmarks/gpu_offline.py"
    if ctx.dry_run:
        ok, msg = import_check(ctx, "offline_8b", script, ["--dry-run"])
        r.status, r.summary = ("ok" if ok else "failed"), msg
        return
    out = ctx.out / "gpu_offline.json"
    rc, text = ctx.run("offline_8b", ctx.py(script, "--json", str(out)), 110)
    if not out.is_file():
        r.status, r.summary = ("timeout" if rc is None else "failed"), f"no figures: {tail(text)}"
        return
    res = json.loads(out.read_text())
    r.figures = res
    r.status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    bits = []
    for row in res["rows"]:
        b = row["batch"]
        if b == 1 and "decode_step_ms" in row:
            bits.append(f"b1 step {row['decode_step_ms']} ms vs weight read {res.get('weight_read_ms')} ms")
        else:
            bits.append(f"b{b} {row['output_tok_s']:.0f} tok/s ({row.get('decode_tok_s', 0):.0f} in decode)")
    r.summary = "; ".join(bits) or "no rows"


def check_run_folder(run: Path) -> dict[str, Any]:
    """What a profiled GPU run must leave: kernel events, kernels.csv, NVML telemetry, report."""
    f: dict[str, Any] = {"run_dir": str(run)}
    trace = run / "trace.json"
    if trace.is_file():
        events = json.loads(trace.read_text()).get("traceEvents", [])
        f["gpu_kernel_events"] = sum(1 for e in events if e.get("cat") == "kernel")
    if (run / "kernels.csv").is_file():
        by_cat: dict[str, float] = {}
        for row in csv.DictReader((run / "kernels.csv").open()):
            by_cat[row["category"]] = by_cat.get(row["category"], 0.0) + float(row["time_ms"])
        f["kernel_ms_by_category"] = {k: round(v, 3) for k, v in by_cat.items()}
    if (run / "telemetry.json").is_file():
        f["telemetry"] = json.loads((run / "telemetry.json").read_text())
    if (run / "telemetry.csv").is_file():
        rows = [row for row in csv.DictReader((run / "telemetry.csv").open()) if row["gpu_index"] != ""]
        for col in ("gpu_util_pct", "gpu_power_w", "gpu_mem_used_mb", "sm_clock_mhz"):
            vals = [float(row[col]) for row in rows if row[col] not in ("", "None")]
            f[f"max_{col}"] = max(vals) if vals else None
    f["report"] = (run / "report.html").is_file()
    f["ok"] = bool(
        f.get("gpu_kernel_events") and f.get("kernel_ms_by_category") and f["report"]
        and f.get("telemetry", {}).get("gpu") and f.get("max_gpu_power_w")
    )  # fmt: skip
    return f


def step_profiled_run(ctx: Context, r: StepResult) -> None:
    run = ctx.out / "profiled_run"
    cmd = ctx.py("-m", "workloads.cli", *PROFILED_RUN_OVERRIDES, f"hydra.run.dir={run}")
    if ctx.dry_run:  # compose the config with these overrides: every key exists and types check
        rc, text = ctx.run("profiled_run", ctx.py("-m", "workloads.cli", "--cfg", "job", *cmd[3:]), 120)
        r.status = "ok" if rc == 0 else "failed"
        r.summary = "servelab-run config composes" if rc == 0 else f"config does not compose: {tail(text, 2)}"
        return
    rc, text = ctx.run("profiled_run", cmd, 80)
    f = check_run_folder(run)
    r.figures = f
    r.status = "timeout" if rc is None else ("ok" if rc == 0 and f["ok"] else "failed")
    r.summary = (
        f"{f.get('gpu_kernel_events', 0)} GPU kernel events; telemetry gpu={f.get('telemetry', {}).get('gpu')}, "
        f"max power {f.get('max_gpu_power_w')} W, max util {f.get('max_gpu_util_pct')} %; report {f['report']}"
    )
    if rc != 0:
        r.summary += f"; {tail(text, 1)}"


STEPS: list[tuple[str, str, Callable[[Context, StepResult], None]]] = [
    ("setup", "CUDA environment (venv / setup.sh / machine python3 + carried wheels)", step_setup),
    ("flash_libs", "FlashAttention / FlashInfer from binary wheels only", step_flash_libs),
    ("gpu_tests", "pytest -m gpu (kernels, backends, engine, sampler, CUDA graphs, NVML)", step_gpu_tests),
    ("attention_kernels", "benchmarks/attention_kernels.py decode + prefill", step_attention_kernels),
    ("offline_8b", "benchmarks/gpu_offline.py Llama-3-8B dummy: batch 1 / 64 / 256", step_offline_8b),
    ("profiled_run", "servelab-run profiling=enabled + NVML telemetry (8B, offline)", step_profiled_run),
]


# ---- driver ----------------------------------------------------------------------------------
def table(ctx: Context, header: dict[str, Any]) -> str:
    lines = [
        f"GPU check{' (dry run)' if ctx.dry_run else ''}: {header['device']}  "
        f"total {header['total_s']:.0f} s of {header['budget_s']:.0f} s",
        f"{'step':<18} {'status':<8} {'time_s':>7}  summary",
    ]
    for res in ctx.results.values():
        lines.append(f"{res.name:<18} {res.status:<8} {res.seconds:>7.1f}  {res.summary}")
        lines += [f"{'':<36}note: {n}" for n in res.notes]
    return "\n".join(lines)


def export(ctx: Context, dest: Path) -> None:
    """At most 8 files (the device tool's limit): the figures, the table, logs, benchmark outputs."""
    dest.mkdir(parents=True, exist_ok=True)
    logs = sorted((ctx.out / "logs").glob("*.log"))
    (dest / "gpu_check.log").write_text("".join(f"==== {p.stem}\n{p.read_text()}\n" for p in logs))
    for name in (
        "gpu_check.json",
        "gpu_check.txt",
        "gpu_tests.xml",
        "attention_kernels.csv",
        "gpu_offline.json",
    ):
        if (ctx.out / name).is_file():
            shutil.copy(ctx.out / name, dest / name)
    run = ctx.out / "profiled_run"
    if run.is_dir():
        with tarfile.open(dest / "profiled_run.tar.gz", "w:gz") as tar:
            tar.add(run, arcname="profiled_run")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="list and check the steps; run nothing on a GPU")
    p.add_argument("--python", default=None, help="interpreter for the steps (default: chosen by setup)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check" / "latest")
    p.add_argument("--export", type=Path, default=None, help="also copy the results (8 files at most) here")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time for the whole check")
    p.add_argument("--steps", default=",".join(s[0] for s in STEPS), help="comma-separated subset, in order")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = args.steps.split(",")
    unknown = [s for s in wanted if s not in {name for name, _, _ in STEPS}]
    if unknown:
        print(f"gpu_check: unknown steps {unknown}; choose from {[s[0] for s in STEPS]}", file=sys.stderr)
        return 2
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    if not args.dry_run:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    t0 = time.monotonic()
    python = args.python or sys.executable
    if shutil.which(python) is None:
        print(
            f"gpu_check: --python {python} is not an executable (run `make setup` or name another)",
            file=sys.stderr,
        )
        return 2
    python = str(Path(shutil.which(python) or python).absolute())
    ctx = Context(args.out, args.dry_run, t0 + args.budget_s, python, args.python is not None, env)
    print(f"gpu_check: {'dry run, ' if args.dry_run else ''}steps {', '.join(wanted)}; results in {args.out}")
    for name, title, fn in STEPS:
        r = ctx.results[name] = StepResult(name, title)
        if name not in wanted:
            r.status, r.summary = "skipped", "not selected (--steps)"
            continue
        if ctx.remaining() < MIN_STEP_S:
            r.status, r.summary = "skipped", "out of time (--budget-s)"
            continue
        print(f"[{name}] {title} ...", flush=True)
        start = time.monotonic()
        try:
            fn(ctx, r)
        except Exception as e:  # a broken step is reported; the next one still runs
            r.status, r.summary = "error", f"{type(e).__name__}: {e}"[:300]
        r.seconds = round(time.monotonic() - start, 1)
        print(f"[{name}] {r.status} ({r.seconds} s): {r.summary}", flush=True)
    device = ctx.results["setup"].figures.get("device") or "no CUDA GPU"
    header = {"device": device, "dry_run": args.dry_run, "budget_s": args.budget_s,
              "total_s": round(time.monotonic() - t0, 1), "python": ctx.python}  # fmt: skip
    doc = {**header, "steps": {n: vars(r) for n, r in ctx.results.items()}}
    (args.out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))
    text = table(ctx, header)
    (args.out / "gpu_check.txt").write_text(text + "\n")
    print("\n" + text)
    if args.export:
        export(ctx, args.export)
    return 0 if all(r.status in ("ok", "skipped") for r in ctx.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
