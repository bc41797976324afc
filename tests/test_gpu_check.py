"""scripts/gpu_check.sh: its dry run in CI, and the driver's parts that need no GPU.

The dry run is what `make gpu-check` does on a machine without a GPU: it must name every
step, check what each step names, and exit 0. The parsers turn each step's output into
figures; they are tested here on small files shaped like the real outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_dry_run_names_and_checks_every_step_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--python", sys.executable, "--out", str(out)],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    names = [name for name, _, _ in gpu_check.STEPS]
    assert names == ["setup", "flash_libs", "gpu_tests", "attention_kernels", "offline_8b", "profiled_run"]
    for name in names:
        assert f"[{name}]" in proc.stdout
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] is True
    assert {n: s["status"] for n, s in doc["steps"].items()} == dict.fromkeys(names, "ok")
    assert doc["steps"]["setup"]["figures"]["missing_modules"] == []
    assert doc["steps"]["gpu_tests"]["figures"]["collected"] >= 30
    assert doc["steps"]["gpu_tests"]["figures"]["files_without_tests"] == []
    table = (out / "gpu_check.txt").read_text()
    assert all(f"\n{name} " in table for name in names)


def test_a_failing_or_broken_step_never_stops_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = []

    def broken(ctx, r):
        ran.append("a")
        raise RuntimeError("boom")

    def failing(ctx, r):
        ran.append("b")
        rc, _ = ctx.run("b", [sys.executable, "-c", "raise SystemExit(3)"], 30)
        r.status, r.summary = ("ok" if rc == 0 else "failed"), f"rc {rc}"

    def fine(ctx, r):
        ran.append("c")
        r.status, r.summary, r.figures = "ok", "fine", {"x": 1}

    steps = [("setup", "a", broken), ("b", "b", failing), ("c", "c", fine)]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    rc = gpu_check.main(["--out", str(tmp_path), "--steps", "setup,b,c", "--python", sys.executable])
    assert rc == 1 and ran == ["a", "b", "c"]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["steps"]["setup"]["status"] == "error" and "boom" in doc["steps"]["setup"]["summary"]
    assert doc["steps"]["b"]["status"] == "failed" and doc["steps"]["b"]["summary"] == "rc 3"
    assert doc["steps"]["c"]["figures"] == {"x": 1}
    assert "[exit: 3]" in (tmp_path / "logs" / "b.log").read_text()


def test_a_step_past_its_box_is_killed_with_its_children(tmp_path: Path) -> None:
    ctx = gpu_check.Context(tmp_path, False, time.monotonic() + 60, sys.executable, True, {})
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    t0 = time.monotonic()
    rc, _ = ctx.run("slow", [sys.executable, "-c", child], box_s=2)
    assert rc is None and time.monotonic() - t0 < 20
    assert "[exit: timeout]" in (tmp_path / "logs" / "slow.log").read_text()


def test_out_of_budget_steps_are_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow(ctx, r):
        ctx.run("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 30)
        r.status = "timeout"

    monkeypatch.setattr(gpu_check, "STEPS", [("setup", "s", slow), ("later", "l", slow)])
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1.0)  # the real 10 s, scaled down
    rc = gpu_check.main(["--out", str(tmp_path), "--budget-s", "2", "--python", sys.executable])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 1 and doc["total_s"] < 15  # the 30 s step was stopped at the budget
    assert doc["steps"]["later"]["status"] == "skipped"
    assert doc["steps"]["later"]["summary"] == "out of time (--budget-s)"


def test_parse_junit_counts_and_names_failures_and_skip_reasons(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_a" file="tests/test_gpu.py"/>'
        '<testcase classname="tests.test_gpu" name="test_b"><failure message="assert 1 == 2">x</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c"><skipped message="flash_attn is not installed"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_d"><skipped message="flash_attn is not installed"/></testcase>'
        "</testsuite></testsuites>"
    )
    res = gpu_check.parse_junit(xml)
    assert (res["passed"], res["failed"], res["skipped"]) == (1, 1, 2)
    assert res["failures"] == ["tests.test_gpu::test_b: assert 1 == 2"]
    assert res["skip_reasons"] == {"flash_attn is not installed": 2}


def test_summarize_attention_keeps_each_implementations_best_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "part,batch,context,impl,ms,GB/s,frac_peak,q_len,TFLOP/s\n"
        "decode,1,1024,triton,0.05,1000.0,0.208,,\n"
        "decode,64,4096,triton,0.4,3900.0,0.812,,\n"
        "decode,64,4096,flash_attn,not installed (flash_attn),,,,\n"
        "prefill,1,4096,triton,1.2,,,4096,300.5\n"
        "prefill,1,1024,sdpa,0.2,,,1024,200.0\n"
    )
    s = gpu_check.summarize_attention(path)
    assert s["decode_best"]["triton"]["GB/s"] == 3900.0 and s["decode_best"]["triton"]["frac_peak"] == 0.812
    assert s["prefill_best"] == {
        "triton": {"TFLOP/s": 300.5, "context": "4096", "ms": 1.2},
        "sdpa": {"TFLOP/s": 200.0, "context": "1024", "ms": 0.2},
    }
    assert s["errors"] == {"flash_attn": "not installed (flash_attn)"}


def test_check_run_folder_wants_kernels_telemetry_and_a_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    events = [{"cat": "kernel", "name": "k"}] * 3 + [{"cat": "cpu_op", "name": "aten::mm"}]
    (run / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (run / "kernels.csv").write_text("step,category,time_ms\n5,gemm,1.5\n5,attention,0.5\n6,gemm,1.0\n")
    (run / "telemetry.json").write_text(json.dumps({"gpu": True, "devices": ["NVIDIA H200"]}))
    (run / "telemetry.csv").write_text(
        "time,cpu_util_pct,rss_mb,gpu_index,gpu_util_pct,gpu_mem_used_mb,gpu_power_w,sm_clock_mhz\n"
        "0.0,10,100,0,5,1000,120.5,1980\n0.5,12,100,0,90,30000,650.0,1980\n"
    )
    f = gpu_check.check_run_folder(run)
    assert not f["ok"]  # no report yet
    (run / "report.html").write_text("<html></html>")
    f = gpu_check.check_run_folder(run)
    assert f["ok"] and f["gpu_kernel_events"] == 3
    assert f["kernel_ms_by_category"] == {"gemm": 2.5, "attention": 0.5}
    assert f["max_gpu_power_w"] == 650.0 and f["max_gpu_util_pct"] == 90.0
    (run / "telemetry.json").write_text(json.dumps({"gpu": False, "reason": "NVML unavailable"}))
    assert not gpu_check.check_run_folder(run)["ok"]


def test_parse_verbose_counts_a_run_stopped_before_its_junit_file() -> None:
    text = (
        "tests/test_gpu.py::test_a[16] PASSED     [ 10%]\n"
        "tests/test_gpu.py::test_b FAILED          [ 20%]\n"
        "tests/test_sampler_device.py::test_c[cuda] SKIPPED (no CUDA GPU) [ 30%]\n"
        "tests/test_triton_kernels.py::test_d PASSED [ 40%]\n"
        "random line PASSED\n"
    )
    res = gpu_check.parse_verbose(text)
    assert (res["passed"], res["failed"], res["skipped"]) == (2, 1, 1)
    assert res["failures"] == ["test_gpu.py::test_b: FAILED"]
