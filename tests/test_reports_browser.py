"""Opens a generated report in headless Chromium: every section renders, no console error.

How: Chromium runs headless with `--enable-logging=stderr --v=0`; it then writes every
console message and uncaught exception of the page to stderr as `...:CONSOLE:...`
lines. The report has no scripts, so any such line (or a failed resource load) is a
failure. `--dump-dom` gives the DOM after load (sections checked there) and a second
run with `--screenshot` keeps test-output/report.png. A control page with a
deliberate console.error proves the detection works.

A rate sweep of the default model on the simulated target (the sweep of
tests/test_sweep_launcher.py, with reports on) saturates at 20000 req/s and skips 40000; its
sweep report and its jobs' run reports are read back from Chromium's DOM (the Pareto front, the
steady-state table, the saturated alert) and screenshotted (checked to be pictures, not blanks).
"""

from __future__ import annotations

import re
import subprocess
import sys
from html import unescape
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from report_fixtures import make_run

from reports.run_report import SECTION_IDS, build_report

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parents[1] / "test-output"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"headless Chromium not found: no {CHROMIUM}")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--hide-scrollbars"]  # fmt: skip
CONSOLE_RE = re.compile(r"CONSOLE|Uncaught|Failed to load resource|Not allowed to load")


def _chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


def _console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if CONSOLE_RE.search(line)]


def test_console_detection_sees_errors(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>console.error('boom'); missing_fn();</script></body></html>")
    lines = _console_lines(_chromium(page, tmp_path / "profile", "--dump-dom").stderr)
    assert any("boom" in x for x in lines) and any("Uncaught ReferenceError" in x for x in lines)


def test_report_renders_in_chromium(tmp_path):
    report = build_report(make_run(tmp_path / "run", gpu=True))
    dom = _chromium(report, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console_lines(dom.stderr) == []
    for sid in SECTION_IDS:
        m = re.search(rf'<section id="{sid}"[^>]*>(.*?)</section>', dom.stdout, re.S)
        assert m and "<h2>" in m.group(1), sid
        assert 'class="missing"' not in m.group(1), sid
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / "report.png"
    shot.unlink(missing_ok=True)
    res = _chromium(report, tmp_path / "profile2", "--window-size=1280,9000", f"--screenshot={shot}")
    assert _console_lines(res.stderr) == []
    assert shot.exists() and shot.stat().st_size > 50_000


RATE_SWEEP = ["workload.arrival.rate=50,20000,40000", "target=simulated", "sim.hardware=h200",
              "sim.gpu_memory_utilization=0.005", "workload=fixed", "workload.num_requests=120",
              "workload.prompt_len.value=2048", "workload.output_len.value=16", "workload.arrival.process=poisson",
              "run.time_reference=false", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]  # fmt: skip


@pytest.fixture(scope="module")
def rate_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The saturating rate sweep (default model, simulated H200 sliver), reports on; its folder."""
    sweep = tmp_path_factory.mktemp("rate-sweep") / "sweep"
    proc = subprocess.run([sys.executable, "-m", "workloads.cli", "-m", *RATE_SWEEP, f"hydra.sweep.dir={sweep}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return sweep


def _section_text(dom: str, sid: str) -> str:
    """The text of one section of a dumped DOM (tags dropped, entities and whitespace folded)."""
    m = re.search(rf'<section id="{sid}"[^>]*>(.*?)</section>', dom, re.S)
    assert m, sid
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", m.group(1))).split())


def _table_rows(dom: str, sid: str) -> list[list[str]]:
    """The body rows (cell texts) of the first table in one section of a dumped DOM."""
    m = re.search(rf'<section id="{sid}"[^>]*>.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert m, sid
    rows = re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)
    return [[unescape(c).strip() for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r, re.S)] for r in rows]


def _screenshot(page: Path, profile: Path, shot: Path, size: tuple[int, int]) -> np.ndarray:
    """Chromium's screenshot of `page` at `size` as a [height, width] grey array; no console line."""
    shot.unlink(missing_ok=True)
    res = _chromium(page, profile, f"--window-size={size[0]},{size[1]}", f"--screenshot={shot}")
    assert _console_lines(res.stderr) == []
    with Image.open(shot) as img:
        assert img.size == size
        return np.asarray(img.convert("L"), dtype=np.float64)


def _is_a_picture(grey: np.ndarray) -> None:
    """Not blank: many pixels off the page's white, and both dark (text) and mid tones (plot, panels)."""
    assert grey.std() > 10, grey.std()
    assert (grey < 250).mean() > 0.05 and (grey < 100).mean() > 0.002


def test_saturating_rate_sweep_report_in_chromium(rate_sweep: Path, tmp_path: Path) -> None:
    jobs = pd.read_csv(rate_sweep / "sweep.csv").set_index("workload.arrival.rate")
    assert bool(jobs.loc[50, "saturated"]) is False and bool(jobs.loc[20000, "saturated"]) is True
    assert "already saturated" in jobs.loc[40000, "error"]  # the sweep stopped at the saturated point

    # The sweep report: the Pareto front over the two rates that ran, each point labelled.
    sweep_page = rate_sweep / "report.html"
    dom = _chromium(sweep_page, tmp_path / "p1", "--dump-dom")
    assert dom.returncode == 0 and _console_lines(dom.stderr) == [], dom.stderr[-2000:]
    pareto = _section_text(dom.stdout, "pareto")
    assert "2 of 2 points on the front" in pareto, pareto
    assert "1 job(s) without figures (skipped or failed) left out" in pareto, pareto  # rate 40000
    front = {row[0].split(",")[0]: row[-1] for row in _table_rows(dom.stdout, "pareto")}
    assert front == {
        "workload.arrival.rate=50": "True",  # faster per user
        "workload.arrival.rate=20000": "True",  # more per instance
    }
    # The best configuration is never the saturated rate, however high its throughput.
    assert "saturated job(s) excluded" in _section_text(dom.stdout, "best-config")
    assert re.search(r'<section id="pareto".*?<img [^>]*alt="Pareto front"', dom.stdout, re.S)
    assert "already saturated" in _section_text(dom.stdout, "failed-jobs")

    # The unsaturated job: its steady-state window and the table beside the whole run.
    run_dirs = {rate: Path(d) for rate, d in jobs["run_dir"].dropna().items()}
    dom = _chromium(run_dirs[50] / "report.html", tmp_path / "p2", "--dump-dom")
    assert _console_lines(dom.stderr) == []
    steady = _section_text(dom.stdout, "steady-state")
    window = re.search(r"Steady state from ([\d.]+) s to ([\d.]+) s", steady)
    assert window and 0 <= float(window[1]) < float(window[2]), steady
    assert "whole run steady state" in steady and "mean_ttft_ms" in steady and "Saturated" not in steady

    # The saturated job: marked as such, and no window.
    saturated_page = run_dirs[20000] / "report.html"
    dom = _chromium(saturated_page, tmp_path / "p3", "--dump-dom")
    assert _console_lines(dom.stderr) == []
    marked = re.search(r'<section id="steady-state".*?<p class="alert">([^<]*)</p>', dom.stdout, re.S)
    assert marked and marked[1].startswith("Saturated: the target no longer kept up"), dom.stdout[-2000:]
    assert "No steady-state window" in _section_text(dom.stdout, "steady-state")

    OUTPUT.mkdir(exist_ok=True)
    _is_a_picture(_screenshot(sweep_page, tmp_path / "p4", OUTPUT / "rate-sweep-report.png", (1280, 2400)))
    _is_a_picture(
        _screenshot(saturated_page, tmp_path / "p5", OUTPUT / "saturated-run-report.png", (1280, 3000))
    )
