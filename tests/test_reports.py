"""report.html and the sweep report from synthetic run folders."""

from __future__ import annotations

import re

from report_fixtures import make_run, make_sweep

from reports.cli import report_main
from reports.run_report import SECTION_IDS, build_report


def _section(html: str, sid: str) -> str:
    m = re.search(rf'<section id="{sid}".*?</section>', html, re.S)
    assert m, f"section {sid} missing"
    return m.group(0)


def test_full_run_report_has_every_section_with_content(tmp_path):
    run = make_run(tmp_path / "run", gpu=True)
    html = build_report(run).read_text()
    for sid in SECTION_IDS:
        body = _section(html, sid)
        assert 'class="missing"' not in body, (sid, body[:400])
    assert len(re.findall(r'src="data:image/png;base64,', html)) >= 12
    assert not re.search(r'(src|href)="https?://', html)  # self-contained
    assert "GPU telemetry" in _section(html, "telemetry")
    assert "kept up" in _section(html, "client-lateness")


def test_partial_run_folder_never_crashes(tmp_path):
    run = make_run(tmp_path / "run", profile=False, gpu=False, error="KeyboardInterrupt: run interrupted")
    (run / "summary.json").unlink()
    (run / "steps.csv").write_text("step,time,num_run")  # truncated by the interruption
    html = build_report(run).read_text()
    assert "No profile recorded" in _section(html, "kernels")
    assert "no GPU telemetry: NVML unavailable" in _section(html, "telemetry")
    assert "summary.json is missing" in _section(html, "summary")
    assert "run interrupted" in _section(html, "errors")
    assert 'class="missing"' in _section(html, "kv-batch")
    assert 'class="missing"' not in _section(html, "latency-distributions")


def test_metrics_only_steps_and_bottlenecked_driver(tmp_path):
    run = make_run(tmp_path / "run", metrics_only=True, telemetry=False)
    s = (run / "summary.json").read_text().replace('"driver_bottleneck": false', '"driver_bottleneck": true')
    (run / "summary.json").write_text(s)
    html = build_report(run).read_text()
    assert "WAS the bottleneck" in _section(html, "client-lateness")
    assert "/metrics" in _section(html, "kv-batch")
    assert "no GPU telemetry" in _section(html, "telemetry")


def test_empty_folder_gives_a_report_saying_what_is_missing(tmp_path):
    html = build_report(tmp_path).read_text()
    assert html.count('class="missing"') >= 8


def test_sweep_report(tmp_path):
    root = make_sweep(tmp_path / "sweep")
    assert report_main([str(root)]) == 0
    html = (root / "report.html").read_text()
    for sid in ("jobs", "throughput-latency", "attention-backends", "best-config"):
        assert 'class="missing"' not in _section(html, sid), sid
    assert "Best: workload.request_rate=" in html


def test_report_cli_missing_folder_exits_2(tmp_path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run folder" in err


def test_sweep_report_reads_the_sweeps_own_report_options(tmp_path):
    """report.sweep.* set for the sweep's runs is used, not the packaged default (issue 13, defect 8)."""
    import yaml

    root = make_sweep(tmp_path / "sweep")
    first = root / "jobs" / "0" / "config.yaml"
    cfg = yaml.safe_load(first.read_text()) if first.exists() else {}
    cfg["report"] = {
        "fallback_slo": {"ttft_ms": None, "tpot_ms": None, "e2el_ms": None},
        "sweep": {"throughput_metric": "output_throughput", "latency_metrics": ["p99_ttft_ms"],
                  "best_by": "output_throughput"},
    }
    first.write_text(yaml.safe_dump(cfg))
    assert report_main([str(root)]) == 0
    html = (root / "report.html").read_text()
    assert "(output_throughput = " in html and "(request_goodput = " not in html
