"""Opens a generated report in headless Chromium: every section renders, no console error.

How: Chromium runs headless with `--enable-logging=stderr --v=0`; it then writes every
console message and uncaught exception of the page to stderr as `...:CONSOLE:...`
lines. The report has no scripts, so any such line (or a failed resource load) is a
failure. `--dump-dom` gives the DOM after load (sections checked there) and a second
run with `--screenshot` keeps test-output/report.png. A control page with a
deliberate console.error proves the detection works.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from report_fixtures import make_run

from reports.run_report import SECTION_IDS, build_report

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parents[1] / "test-output"
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium not installed")

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
