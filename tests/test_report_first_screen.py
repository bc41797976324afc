"""The run report's first screen: a saturated run or one without a request inside its SLOs says so
above every figure, and the header names the kernels and CPU flags that ran (issue: no silent
fallback, the report's first screen says when a run was saturated)."""

from __future__ import annotations

import json
from pathlib import Path

from reports.run_report import build_report, first_screen_alerts, machine_line
from tests.report_fixtures import make_run


def _with_summary(run: Path, **extra: object) -> None:
    path = run / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | extra))


def test_a_saturated_run_says_so_before_any_section(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    _with_summary(run, saturated=True, saturation="queue grew 40 requests over the last third",
                  dtype="float32", block_linear="avx2", cpu_flags="avx2 fma f16c")
    html = build_report(run).read_text()
    banner = html.index("Saturated: the target no longer kept up (queue grew 40 requests")
    first_section = html.index('<section id="workload-config"')
    assert banner < first_section
    assert "block_linear=avx2, cpu_flags=avx2 fma f16c" in html[:first_section]


def test_an_unsaturated_run_within_its_slos_has_no_alert(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    _with_summary(run, saturated=False, request_goodput=3.2)
    html = build_report(run).read_text()
    assert 'class="alert banner"' not in html


def test_alerts_and_machine_line_from_the_summary() -> None:
    assert first_screen_alerts({"saturated": None, "saturation": "closed loop: not tested"}) == []
    alerts = first_screen_alerts({"saturated": False, "request_goodput": 0.0, "completed": 64})
    assert len(alerts) == 1 and alerts[0].startswith("No request met its SLOs (goodput 0)")
    assert first_screen_alerts({"request_goodput": 0.0, "completed": 0}) == []  # nothing finished: the errors say why
    assert machine_line({"dtype": "bfloat16", "bfloat16_linear": "amx", "block_linear": "avx512-vnni"}) == (
        "dtype=bfloat16, bfloat16_linear=amx, block_linear=avx512-vnni")
    assert machine_line({}) == ""
