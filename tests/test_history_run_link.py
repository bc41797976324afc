"""A recorded run folder links its report to its history (history/run_link.py, reports/run_report.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from history.cli import history_main, record_after_run
from history.run_link import shown_url
from history.store import Store
from reports.run_report import build_report, history_link


def _git(repo: Path, *args: str, when: int | None = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    if when is not None:  # distinct committer times: the series is ordered by them
        env |= {"GIT_COMMITTER_DATE": f"{when} +0000", "GIT_AUTHOR_DATE": f"{when} +0000"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()  # fmt: skip


def _repo(tmp_path: Path, commits: int) -> tuple[Path, list[str]]:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    shas = []
    for i in range(commits):
        (repo / "f.txt").write_text(f"{i}\n")
        _git(repo, "add", "f.txt")
        _git(repo, "commit", "-q", "-m", f"commit {i}", when=1_800_000_000 + 60 * i)
        shas.append(_git(repo, "rev-parse", "HEAD"))
    return repo, shas


def _run_folder(path: Path, cpu_ms: float, name: str = "ci_gate", budget: int = 1) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"output_throughput": 50.0 + cpu_ms, "cpu_ms_per_token": cpu_ms,
                                                   "model": "smollm2"}))  # fmt: skip
    (path / "config.yaml").write_text(f"run: {{name: {name}, output_dir: {path.parent}}}\nscheduler: {{x: {budget}}}\n")
    build_report(path)  # as servelab-run leaves it: a report, no history yet
    return path


def test_a_recorded_run_gets_its_history_page_and_its_report_links_to_it(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    repo, _ = _repo(tmp_path, 1)
    run = _run_folder(tmp_path / "r1", 2.5)
    assert history_link(run) is None and "Performance history" not in (run / "report.html").read_text()
    url = str(tmp_path / "h.sqlite")
    record_after_run(url, [str(run)], repo)
    assert capsys.readouterr().err == ""
    meta = json.loads((run / "history.json").read_text())
    assert meta["report"] == "history.html" and meta["store"] == url and meta["series"] == 2
    assert meta["commits"] == 1 and meta["change_points"] == 0 and meta["dirty"] is False
    page = (run / "history.html").read_text()
    assert "cpu_ms_per_token" in page and "output_throughput" in page
    report = (run / "report.html").read_text()
    assert '<a href="history.html">Performance history</a>' in report
    assert "2 series of this config on this machine over 1 commit(s), 0 change point(s)" in report
    with Store(url) as store:
        assert len(store.runs()) == 1


def test_the_page_holds_only_the_runs_series_and_names_a_step_in_them(tmp_path: Path) -> None:
    repo, shas = _repo(tmp_path, 24)
    url = str(tmp_path / "h.sqlite")
    for i, sha in enumerate(shas[:-1]):  # a +10% step in CPU time per token at commit 12
        run = _run_folder(tmp_path / f"r{i}", 2.0 * (1.1 if i >= 12 else 1.0) * (1 + 0.003 * (i % 3 - 1)))
        assert history_main(["record", str(run), "--commit", sha, "--no-link", "--history", url,
                             "--repo", str(repo)]) == 0  # fmt: skip
        assert not (run / "history.json").exists()
    other = _run_folder(tmp_path / "other", 9.0, "other_workload", budget=2)  # another config: another series
    assert history_main(["record", str(other), "--history", url, "--repo", str(repo)]) == 0
    last = _run_folder(tmp_path / "last", 2.2)
    record_after_run(url, [str(last)], repo)
    meta = json.loads((last / "history.json").read_text())
    assert meta["series"] == 2 and meta["commits"] == 24 and meta["config_name"] == "ci_gate"
    assert meta["change_points"] >= 1 and meta["regressions"] >= 1
    page = (last / "history.html").read_text()
    assert "other_workload" not in page and f"{shas[11][:10]}..{shas[12][:10]}" in page
    link = history_link(last)
    assert link is not None and "of them regressions" in link.text
    assert "of them regressions" in (last / "report.html").read_text()
    other_meta = json.loads((other / "history.json").read_text())
    assert other_meta["series"] == 2 and other_meta["commits"] == 1 and other_meta["change_points"] == 0


def test_a_dirty_run_says_it_is_not_in_the_series(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path, 1)
    (repo / "f.txt").write_text("changed\n")
    run = _run_folder(tmp_path / "r", 2.5)
    record_after_run(str(tmp_path / "h.sqlite"), [str(run)], repo)
    link = history_link(run)
    assert link is not None and "uncommitted changes, so it is not in the series" in link.text
    assert json.loads((run / "history.json").read_text())["series"] == 0


def test_no_link_without_a_readable_history_json_and_its_page(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    assert history_link(run) is None
    (run / "history.json").write_text("{not json")
    assert history_link(run) is None
    (run / "history.json").write_text(json.dumps({"report": "history.html"}))
    assert history_link(run) is None  # the page is gone: no dead link
    (run / "history.html").write_text("<html></html>")
    assert history_link(run) is not None


def test_a_page_that_cannot_be_written_costs_one_line_never_the_record(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import history.run_link

    def broken(*args: object, **kwargs: object) -> Path:
        raise OSError("disk full")

    monkeypatch.setattr(history.run_link, "link_run_history", broken)
    repo, _ = _repo(tmp_path, 1)
    run = _run_folder(tmp_path / "r", 2.5)
    url = str(tmp_path / "h.sqlite")
    record_after_run(url, [str(run)], repo)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recorded, but its history page was not written: OSError: disk full" in err
    with Store(url) as store:
        assert len(store.runs()) == 1


def test_a_store_password_never_reaches_the_page() -> None:
    assert shown_url("postgresql+psycopg://ci:s3cret@db:5432/perf") == "postgresql+psycopg://ci:***@db:5432/perf"
    assert shown_url("runs/history.sqlite") == "runs/history.sqlite"
