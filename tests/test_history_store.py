"""The results store (history/store.py, history/schema.py) on SQLite and on a real PostgreSQL server.

PostgreSQL: the test starts its own server from Debian's `postgresql` package (initdb / pg_ctl in
a temporary folder, as the `postgres` user when run as root) and skips, naming the package,
where it is not installed (scripts/install_postgres.sh installs it for CI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from history.ingest import load_record
from history.schema import LATEST, MIGRATIONS, SchemaTooNew, migrate
from history.store import Store, make_engine
from history.synthetic import synthetic_records

ROOT = Path(__file__).resolve().parents[1]
PG_PACKAGE = "postgresql (Debian package; scripts/install_postgres.sh)"


def _pg_bindir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    """A PostgreSQL server of its own for this module; its SQLAlchemy URL (database `postgres`)."""
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip(f"no PostgreSQL server: {PG_PACKAGE} is not installed")
    pytest.importorskip("psycopg", reason="psycopg (the PostgreSQL driver) is not installed")
    as_root = os.geteuid() == 0
    if as_root and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start PostgreSQL as another user")
    base = Path(tempfile.mkdtemp(prefix="servelab-pg-", dir="/tmp"))
    base.chmod(0o755)
    data, port = base / "data", _free_port()
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    if as_root:
        shutil.chown(base, "postgres")

    def pg(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=60)

    init = pg(str(bindir / "initdb"), "-D", str(data), "-U", "servelab", "--auth=trust", "-E", "UTF8")
    if init.returncode != 0:
        pytest.skip(f"initdb failed: {init.stderr.strip()[-300:]}")
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
    start = pg(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "start")
    if start.returncode != 0:
        pytest.skip(f"pg_ctl start failed: {start.stderr.strip()[-300:]}")
    try:
        yield f"postgresql+psycopg://servelab@127.0.0.1:{port}/postgres"
    finally:
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store on each backend."""
    if request.param == "sqlite":
        yield str(tmp_path / "history.sqlite")
        return
    server = request.getfixturevalue("pg_server")
    name = f"h{os.getpid()}_{int(time.time() * 1e6) % 10**9}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f"CREATE DATABASE {name}")
    admin.dispose()
    yield server.rsplit("/", 1)[0] + f"/{name}"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _repo(tmp_path: Path, commits: int = 2) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    for i in range(commits):
        (repo / "f.txt").write_text(f"{i}\n")
        _git(repo, "add", "f.txt")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"commit {i}")
    return repo


def _run_folder(path: Path, cpu_ms: float) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"output_throughput": 50.0, "cpu_ms_per_token": cpu_ms,
                                                   "failed": 0, "partial": False, "model": "smollm2"}))  # fmt: skip
    (path / "config.yaml").write_text("run: {name: ci_gate, output_dir: " + str(path.parent) + "}\nscheduler: {x: 1}\n")
    return path


def _gate_json(path: Path, base: str, cand: float, change: float, verdict: str = "pass") -> Path:
    checks = [{"metric": "cpu_ms_per_token", "baseline": cand / (1 + change), "candidate": cand, "change": change,
               "interval": [change - 0.02, change + 0.02], "verdict": "REGRESSION" if verdict == "fail" else "ok",
               "rule": {"direction": "lower", "tolerance": 0.05, "kind": "time", "gate": True}, "p_value": 0.1,
               "generations": 4}]  # fmt: skip
    path.write_text(json.dumps({"verdict": verdict, "baseline_commit": base, "pairs": 8, "checks": checks,
                                "candidate_reps": [{"cpu_ms_per_token": cand}], "elapsed_s": 100.0}))  # fmt: skip
    return path


def test_record_a_run_folder_and_a_gate_with_commit_machine_and_versions(store_url: str, tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    head, parent = _git(repo, "rev-parse", "HEAD"), _git(repo, "rev-parse", "HEAD~1")
    run = _run_folder(tmp_path / "runs" / "a", 2.5)
    gate = _gate_json(tmp_path / "gate.json", parent, 2.6, 0.04)
    with Store(store_url) as store:
        assert store.version == LATEST
        assert store.add(load_record(run, repo)) is not None
        assert store.add(load_record(gate, repo, gate_config=ROOT / "conf" / "gate" / "paired.yaml")) is not None
        assert store.add(load_record(run, repo)) is None  # the same input twice: stored once
        runs = store.runs()
        rows = store.measurements()
    assert list(runs["kind"]) == ["run", "gate"]
    assert set(runs["commit_sha"]) == {head}
    assert runs["cpu_model"].str.len().min() > 0 and runs["machine_fp"].str.len().eq(12).all()
    assert (runs["torch_version"] != "").all() and (runs["engine_version"] != "").all()
    assert runs["config_digest"].nunique() == 2 and runs.iloc[0]["config_name"] == "ci_gate"
    run_values = rows[rows["kind"] == "run"].set_index("metric")["value"]
    assert run_values["cpu_ms_per_token"] == 2.5 and "partial" not in run_values and "model" not in run_values
    gate_rows = rows[rows["kind"] == "gate"].set_index("role")
    assert gate_rows.loc["candidate", "commit_sha"] == head and gate_rows.loc["baseline", "commit_sha"] == parent
    assert gate_rows.loc["candidate", "change"] == pytest.approx(0.04)
    assert gate_rows.loc["candidate", "direction"] == "lower"
    assert gate_rows.loc["baseline", "value"] == pytest.approx(2.6 / 1.04)


def test_the_config_digest_ignores_where_a_run_was_written(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    a = load_record(_run_folder(tmp_path / "x" / "a", 2.5), repo)
    b = load_record(_run_folder(tmp_path / "y" / "b", 2.5), repo)
    assert a.config_digest == b.config_digest
    assert a.source_digest == b.source_digest  # the same figures of the same commit: one record


def test_a_dirty_checkout_is_marked_and_left_out_of_series(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "f.txt").write_text("changed\n")
    rec = load_record(_run_folder(tmp_path / "r", 2.5), repo)
    assert rec.commit.dirty
    with Store(str(tmp_path / "h.sqlite")) as store:
        store.add(rec)
        assert store.measurements().empty and len(store.measurements(include_dirty=True)) == 3  # 3 numbers


def test_a_fresh_store_migrates_and_an_old_one_keeps_its_rows(store_url: str) -> None:
    engine = make_engine(store_url)
    with engine.begin() as conn:
        assert migrate(conn, target=1) == (0, 1)
        run_id = conn.execute(sa.text(
            "INSERT INTO runs (source_digest, kind, recorded_at, commit_sha, commit_time, commit_subject, dirty, "
            "branch, config_digest, config_name, machine_fp, cpu_model, cpu_flags, cores, arch, torch_version, "
            "engine_version, python_version, source_path) VALUES ('d', 'run', 1, 'abc', 1, 's', false, '', 'c', '', "
            "'m', 'cpu', '', 2, 'x86_64', 't', 'e', 'p', '') RETURNING id")).scalar()  # fmt: skip
        conn.execute(sa.text("INSERT INTO measurements (run_id, commit_sha, commit_time, role, metric, value) "
                             "VALUES (:r, 'abc', 1, 'run', 'm', 1.5)"), {"r": run_id})  # fmt: skip
    engine.dispose()
    with Store(store_url) as store:
        assert (store.migrated_from, store.version) == (1, LATEST) and LATEST == len(MIGRATIONS) >= 2
        rows = store.measurements()
        assert list(rows["value"]) == [1.5] and rows["direction"].isna().all()
    with Store(store_url) as store:
        assert store.migrated_from == LATEST  # nothing to do the second time


def test_a_store_newer_than_the_code_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "h.sqlite")
    Store(url).close()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE servelab_schema SET version = {LATEST + 1}")
    engine.dispose()
    with pytest.raises(SchemaTooNew, match="upgrade servelab"):
        Store(url)


WRITER = textwrap.dedent("""
    import sys, time, numpy as np
    from history.store import Store, insert_record
    from history.synthetic import synthetic_records
    url, tag, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    recs = synthetic_records(np.linspace(1, 2, n), tag=tag)
    store = Store(url)
    if mode == "kill-inside":  # stored whole, then one record left half-written when the process dies
        for r in recs[:-1]:
            store.add(r)
        with store.transaction() as conn:
            insert_record(conn, recs[-1])
            print("inside", flush=True)
            time.sleep(60)
    else:
        for r in recs:
            assert store.add(r) is not None
        print("done", flush=True)
""")


def _writer(url: str, tag: str, n: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, url, tag, str(n), mode], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def test_a_killed_writer_loses_only_its_unfinished_record(store_url: str) -> None:
    proc = _writer(store_url, "killed", 6, "kill-inside")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "inside", proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    recs = synthetic_records(np.linspace(1, 2, 6), tag="killed")
    with Store(store_url) as store:
        runs = store.runs()
        assert len(runs) == 5 and len(store.measurements()) == 5  # the five committed, nothing of the sixth
        assert store.add(recs[-1]) is not None  # its input can be recorded again
        assert len(store.runs()) == 6


def test_two_writers_at_once_lose_nothing(store_url: str) -> None:
    Store(store_url).close()  # migrated first: the writers race on records, not on the schema
    procs = [_writer(store_url, f"w{i}", 20, "all") for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "done", err[-2000:]
    with Store(store_url) as store:
        assert len(store.runs()) == 40 and len(store.measurements()) == 40


def test_two_processes_opening_a_fresh_store_build_it_once(store_url: str) -> None:
    procs = [_writer(store_url, f"f{i}", 3, "all") for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    with Store(store_url) as store:
        assert store.migrated_from == LATEST and len(store.runs()) == 6


def test_record_cli_prints_what_it_stored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from history.cli import history_main

    repo = _repo(tmp_path)
    run = _run_folder(tmp_path / "r", 2.5)
    url = str(tmp_path / "h.sqlite")
    assert history_main(["record", str(run), "--history", url, "--repo", str(repo)]) == 0
    assert history_main(["record", str(run), "--history", url, "--repo", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "recorded" in out and "already recorded" in out
    assert history_main(["record", str(tmp_path / "nothing"), "--history", url, "--repo", str(repo)]) == 2
    assert "not a run folder or gate.json" in capsys.readouterr().err


def test_servelab_run_history_hook_records_and_never_fails_the_run(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """`servelab-run run.history=URL` (workloads/cli.py) calls record_after_run with its finished run folders."""
    from history.cli import record_after_run

    repo = _repo(tmp_path)
    runs = [str(_run_folder(tmp_path / "r1", 2.5)), str(_run_folder(tmp_path / "r2", 2.6))]
    url = str(tmp_path / "h.sqlite")
    record_after_run(url, runs, repo)
    with Store(url) as store:
        assert len(store.runs()) == 2
    record_after_run("postgresql+psycopg://nobody@127.0.0.1:1/none", runs, repo)  # no server there
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.history: not recorded: OperationalError" in err


def test_servelab_gate_history_records_its_gate_json_and_never_changes_the_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`servelab-gate --against REF --history URL`: the finished gate's gate.json goes into the store at
    the checkout's commit; a store that cannot be reached is one line on stderr and the gate's exit
    code is its verdict's."""
    from workloads import gate_cli
    from workloads.paired_gate import GateResult

    repo = _repo(tmp_path)
    parent = _git(repo, "rev-parse", "HEAD~1")
    out = tmp_path / "gate"
    out.mkdir()
    _gate_json(out / "gate.json", parent, 2.6, 0.04)
    result = GateResult(baseline_commit=parent, baseline_tree="", checks=[], baseline_reps=[], candidate_reps=[],
                        pairs=8, discarded=0, elapsed_s=1.0, notes=[], out_dir=str(out))  # fmt: skip
    monkeypatch.setattr(gate_cli, "run_paired_gate", lambda *a, **k: result)
    url = str(tmp_path / "h.sqlite")
    assert gate_cli.gate_main(["--against", "HEAD~1", "--repo", str(repo), "--history", url]) == 0
    with Store(url) as store:
        runs = store.runs()
    assert len(runs) == 1 and runs.iloc[0]["kind"] == "gate"
    assert runs.iloc[0]["commit_sha"] == _git(repo, "rev-parse", "HEAD") and runs.iloc[0]["baseline_commit"] == parent
    assert "history: gate at" in capsys.readouterr().out
    bad = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    assert gate_cli.gate_main(["--against", "HEAD~1", "--repo", str(repo), "--history", bad]) == 0
    assert "--history: not recorded: OperationalError" in capsys.readouterr().err


def test_since_keeps_the_commits_from_a_ref_on(tmp_path: Path) -> None:
    from history.cli import _scan, history_parser

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    url = str(tmp_path / "h.sqlite")
    with Store(url) as store:
        for i in range(4):
            (repo / "f.txt").write_text(f"{i}\n")
            _git(repo, "add", "f.txt")
            date = f"@{1_700_000_000 + 3600 * i} +0000"
            subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
                            f"c{i}"], check=True, env={**os.environ, "GIT_COMMITTER_DATE": date})  # fmt: skip
            store.add(load_record(_run_folder(tmp_path / f"r{i}", 2.0 + i), repo))
    args = history_parser().parse_args(["changes", "--history", url, "--repo", str(repo), "--metric",
                                        "cpu_ms_per_token", "--since", "HEAD~1"])  # fmt: skip
    (series,) = _scan(args).series
    assert [p.value for p in series.points] == [4.0, 5.0]
