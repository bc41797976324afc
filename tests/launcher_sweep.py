"""A 2x2 sweep of simulated-target jobs, run through any Hydra launcher, and its comparison with
the basic launcher's (tests/test_launcher_ray.py, tests/test_launcher_submitit.py).

The simulated target is deterministic in everything but wall-clock figures, so a launcher that
runs the jobs elsewhere (Ray workers, submitit processes) must give the same sweep folder (one
job folder per job, with its run files), the same sweep.csv rows on every simulated figure, and
a sweep report with the same sections and jobs.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ["target=simulated", "sim.hardware=h200", "sim.gpu_memory_utilization=0.01", "workload=fixed",
         "workload.num_requests=4", "workload.prompt_len.value=16,48", "workload.output_len.value=4",
         "run.time_reference=false", "scheduler.max_num_batched_tokens=8,64", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
KEYS = ["workload.prompt_len.value", "scheduler.max_num_batched_tokens"]
# Figures of the simulated clock and the token counts: equal whichever process ran the job.
FIGURES = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "num_steps",
           "num_preemptions", "prefix_cache_hit_rate", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
           "mean_itl_ms", "mean_e2el_ms", "mean_server_prefill_ms", "mean_server_decode_ms", "saturated"]
RUN_FILES = {"config.yaml", "overrides.json", "requests.csv", "steps.csv", "summary.json", "report.html"}


def run_sweep(sweep_dir: Path, launcher: list[str], python: str = sys.executable,
              env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run the 2x2 sweep into `sweep_dir` with `launcher` overrides; returns its output (asserts exit 0)."""
    proc = subprocess.run([python, "-m", "workloads.cli", "-m", *SWEEP, *launcher, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    return out


@functools.cache
def basic_sweep() -> Path:
    """The basic launcher's sweep folder, run once per test session (both launcher tests compare with it)."""
    folder = Path(tempfile.mkdtemp(prefix="servelab-basic-sweep-"))
    atexit.register(shutil.rmtree, folder, True)
    run_sweep(folder / "sweep", [])
    return folder / "sweep"


def sections(page: str) -> list[str]:
    """The report's section titles and its figures' captions, in order."""
    return re.findall(r"<h2[^>]*>([^<]*)|<img alt=\"([^\"]*)", page)


def jobs_table(page: str) -> list[list[str]]:
    """The rows of the report's Jobs table (one per job, cells as printed), sorted."""
    table = page[page.index("<h2>Jobs"):].split("</table>", 1)[0]
    rows = [re.findall(r"<td>([^<]*)</td>", row) for row in table.split("<tr")]
    return sorted(r for r in rows if r)


def assert_same_sweep(got: Path, want: Path) -> None:
    """`got` (a launcher's sweep folder) holds what the basic launcher's `want` holds."""
    jobs = sorted(p.name for p in want.iterdir() if p.is_dir())
    assert len(jobs) == 4
    assert sorted(p.name for p in got.iterdir() if p.is_dir()) == jobs
    for job in jobs:
        assert {p.name for p in (got / job).iterdir()} >= RUN_FILES, job
    a = pd.read_csv(got / "sweep.csv").set_index(KEYS).sort_index()
    b = pd.read_csv(want / "sweep.csv").set_index(KEYS).sort_index()
    assert list(a.index) == list(b.index) and len(a) == 4
    assert a["completed"].eq(4).all()
    pd.testing.assert_frame_equal(a[FIGURES], b[FIGURES], check_exact=False, rtol=1e-9)
    page_a, page_b = (got / "report.html").read_text(), (want / "report.html").read_text()
    assert sections(page_a) == sections(page_b) and ("Jobs", "") in sections(page_a)
    assert jobs_table(page_a) == jobs_table(page_b) and len(jobs_table(page_a)) == 4
