"""Change points (history/changes.py), the history report and the CI summary, on synthetic histories.

The acceptance case of issue 59: 60 commits at the paired gate's noise level on this machine
(benchmarks/gate_power_2026-12-05.jsonl), steps of +8% at commit 20 and +15% at commit 40: both
found at those commits; a noise-only series of 60 gives none.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from history.changes import Settings, find_splits, scan
from history.cli import history_main
from history.machine import Machine
from history.store import Store
from history.summary import summary_markdown
from history.synthetic import STEPS, TEST_MACHINE, gate_noise, history, synthetic_records


@pytest.fixture(scope="module")
def sigma() -> float:
    s = gate_noise()
    assert 0.002 < s < 0.05  # a CPU-time-per-token estimate's spread, as the power runs measured it
    return s


def _store(tmp_path: Path, *series: list) -> str:
    url = str(tmp_path / "h.sqlite")
    with Store(url) as store:
        for records in series:
            for r in records:
                assert store.add(r) is not None
    return url


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_steps_are_found_at_their_commits_through_the_store(tmp_path: Path, sigma: float, seed: int) -> None:
    values = history(60, sigma, STEPS, np.random.default_rng(seed))
    records = synthetic_records(values)
    with Store(_store(tmp_path, records)) as store:
        result = scan(store.measurements())
    (series,) = result.series
    changes = result.changes[series.key]
    commits = [r.commit.sha for r in records]
    assert [c.first_after for c in changes] == [commits[20], commits[40]]
    assert [c.last_before for c in changes] == [commits[19], commits[39]]
    for c, (_, step) in zip(changes, STEPS, strict=True):
        assert c.interval[0] < step < c.interval[1]  # the interval holds the injected step
        assert c.interval[1] - c.interval[0] < 0.04
        assert c.p_value <= 0.01 and c.kind == "regression"


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_a_noise_only_series_of_60_has_no_change_point(sigma: float, seed: int) -> None:
    assert find_splits(history(60, sigma, (), np.random.default_rng(100 + seed))) == []


def test_heavy_tailed_noise_gives_no_change_point_either(sigma: float) -> None:
    assert find_splits(history(60, sigma, (), np.random.default_rng(7), tails="t3")) == []


def test_an_improvement_is_named_one(sigma: float) -> None:
    values = history(40, sigma, ((25, -0.10),), np.random.default_rng(3))
    with_settings = Settings(min_change=0.05)
    (split,) = find_splits(values, with_settings)
    assert split.index == 25


def test_machines_are_never_mixed(tmp_path: Path, sigma: float) -> None:
    """The same commits on two CPUs, one 20% slower throughout: two flat series, no change point
    (mixed in one series by time, they would alternate and look like noise or steps)."""
    rng = np.random.default_rng(5)
    other = Machine("Other CPU", ("avx512f",), 16, "x86_64")
    fast = synthetic_records(history(30, sigma, (), rng))
    slow = synthetic_records(history(30, sigma, (), rng) * 1.2, machine=other)
    with Store(_store(tmp_path, fast[:15], slow, fast[15:])) as store:
        result = scan(store.measurements())
    assert {s.key.machine for s in result.series} == {TEST_MACHINE.fingerprint, other.fingerprint}
    assert all(len(s.points) == 30 for s in result.series)
    assert result.all_changes() == []


def test_changes_cli_since_and_metric(tmp_path: Path, sigma: float, capsys: pytest.CaptureFixture[str]) -> None:
    records = synthetic_records(history(60, sigma, STEPS, np.random.default_rng(0)))
    url = _store(tmp_path, records)
    assert history_main(["changes", "--history", url, "--metric", "cpu_ms_per_token",
                         "--json", str(tmp_path / "c.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "2 change point(s)" in out and f"{records[19].commit.sha[:10]}..{records[20].commit.sha[:10]}" in out
    found = json.loads((tmp_path / "c.json").read_text())
    assert [c["first_after"] for c in found] == [records[40].commit.sha, records[20].commit.sha]  # most significant first
    assert history_main(["changes", "--history", url, "--metric", "no_such_metric"]) == 0
    assert "0 series, 0 change point(s)" in capsys.readouterr().out
    assert history_main(["changes", "--history", url, "--fail-on-regression"]) == 1


def test_report_marks_change_points_and_gate_verdicts(tmp_path: Path, sigma: float) -> None:
    records = synthetic_records(history(40, sigma, ((20, 0.10),), np.random.default_rng(1)))
    url = _store(tmp_path, records)
    out = tmp_path / "report.html"
    assert history_main(["report", "--history", url, "--out", str(out)]) == 0
    page = out.read_text()
    with Store(url) as store:
        (change,) = scan(store.measurements()).all_changes()
    assert change.first_after == records[20].commit.sha
    assert page.count("data:image/png;base64,") == 1  # the one series' figure
    assert f"{change.change:+.1%}" in page and f"{records[19].commit.sha[:10]}..{records[20].commit.sha[:10]}" in page


def test_summary_markdown_has_the_verdict_table_and_top_changes(tmp_path: Path, sigma: float) -> None:
    gate = {"verdict": "fail", "baseline_commit": "a" * 40, "pairs": 8, "elapsed_s": 120.0, "checks": [
        {"metric": "step_ms", "baseline": 2.0, "candidate": 2.0, "change": 0.0, "interval": [-0.01, 0.01],
         "verdict": "(ok)", "rule": {"gate": False}},
        {"metric": "cpu_ms_per_token", "baseline": 2.0, "candidate": 2.3, "change": 0.15, "interval": [0.1, 0.2],
         "verdict": "REGRESSION", "rule": {"gate": True}},
    ]}  # fmt: skip
    records = synthetic_records(history(60, sigma, STEPS, np.random.default_rng(0)))
    with Store(_store(tmp_path, records)) as store:
        changes = scan(store.measurements()).all_changes()
    md = summary_markdown(gate, changes, top=1)
    lines = md.splitlines()
    assert lines[0].startswith("### :x: Performance gate: FAIL (1 regression(s) in 2 metrics")
    table = [ln for ln in lines if ln.startswith("| `")]
    assert table[0].startswith("| `cpu_ms_per_token` | 2 | 2.3 | +15.0% | +10.0% .. +20.0% | **REGRESSION**")
    assert "(top 1)" in md and f"`{records[39].commit.sha[:10]}..{records[40].commit.sha[:10]}`" in md
    step_file = tmp_path / "step_summary.md"
    (tmp_path / "gate.json").write_text(json.dumps(gate))
    url = str(tmp_path / "h.sqlite")
    assert history_main(["summary", str(tmp_path / "gate.json"), "--history", url, "--with-history",
                         "--out", str(step_file)]) == 0  # fmt: skip
    assert step_file.read_text().count("| metric |") == 2
