"""Run folders survive interruption (issue 13, item 5).

Ctrl-C (SIGINT) in the middle of `servelab-run`: requests.csv holds every request that
finished and summary.json says `partial: true`. A harness killed outright (SIGKILL) leaves
the journal of finished requests; `servelab-report` rebuilds requests.csv, a partial
summary and the report from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from analysis.runfolder import JOURNAL
from reports.cli import report_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]
LONG_RUN = [
    "model.load_format=dummy", "model.num_layers_override=2", "workload=fixed", "workload.num_requests=400",
    "workload.warmup_requests=0", "workload.prompt_len.value=16", "workload.output_len.value=24",
    "workload.arrival.rate=8", "run.time_reference=false", "slo.ttft_ms=1000",
    "report.html=false",  # the harness's own page; servelab-report rebuilds one in the second test
]  # fmt: skip


def _start(run_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "workloads.cli", *LONG_RUN, f"hydra.run.dir={run_dir}"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _wait_for_finished(run_dir: Path, n: int, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> int:
    journal = run_dir / JOURNAL
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if journal.exists():
            lines = journal.read_text().count("\n")
            if lines >= n:
                return lines
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} requests finished in {timeout_s} s")


def test_ctrl_c_keeps_every_finished_request_and_marks_the_summary_partial(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    seen = _wait_for_finished(run_dir, 10, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) != 0  # an interrupted run is not a success
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partial"] is True
    requests = pd.read_csv(run_dir / "requests.csv")
    finished = requests[requests["error"].isna()]
    assert len(finished) >= seen and summary["completed"] == len(finished)
    assert not (run_dir / JOURNAL).exists()


def test_killed_harness_is_rebuilt_by_servelab_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    seen = _wait_for_finished(run_dir, 10, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)
    assert not (run_dir / "summary.json").exists()
    assert report_main([str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partial"] is True and summary["completed"] >= seen
    assert len(pd.read_csv(run_dir / "requests.csv")) >= seen
    assert (run_dir / "report.html").exists()
