"""servelab-compare: change and "beyond noise?" per summary metric."""

from __future__ import annotations

import pytest
from report_fixtures import make_run

from reports.cli import compare_main
from reports.compare import compare
from reports.gate import load_gate_config


def test_compare_flags_real_change_not_identical(tmp_path):
    a = make_run(tmp_path / "a", profile=False, telemetry=False)
    b = make_run(tmp_path / "b", slow=1.5, profile=False, telemetry=False)
    df = compare(a, b, load_gate_config()).set_index("metric")
    assert df.loc["median_tpot_ms", "change_pct"] == pytest.approx(50, rel=1e-6)
    assert df.loc["median_tpot_ms", "beyond_noise"] == "yes"
    assert df.loc["median_tpot_ms", "method"].startswith("bootstrap over requests")
    assert df.loc["num_steps", "method"].startswith("tolerance")
    same = compare(a, a, load_gate_config())
    assert (same["beyond_noise"] == "no").all() and (same["change_pct"] == 0).all()


def test_compare_repeats_use_runs(tmp_path):
    for i in range(3):
        make_run(tmp_path / "A" / f"r{i}", seed=i, profile=False, telemetry=False)
        make_run(tmp_path / "B" / f"r{i}", seed=10 + i, profile=False, telemetry=False)
    df = compare(tmp_path / "A", tmp_path / "B", load_gate_config()).set_index("metric")
    assert df.loc["output_throughput", "method"].startswith("bootstrap over runs")


def test_compare_cli_prints_table_and_html(tmp_path, capsys):
    a = make_run(tmp_path / "a", profile=False, telemetry=False)
    out = tmp_path / "cmp.html"
    assert compare_main([str(a), str(a), "--html", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean_tpot_ms" in text and "beyond_noise" in text
    assert 'id="comparison"' in out.read_text()
    assert compare_main([str(a), str(tmp_path / "missing")]) == 2
