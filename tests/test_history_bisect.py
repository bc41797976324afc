"""servelab-bisect (history/bisect.py) on a throwaway git repository with a stand-in gate.

The stand-in gate reads the "cost" of the checkout and of GOOD from cost.txt, and writes a
gate.json as `servelab-gate --against` does: the change with noise at the paired gate's level
(sd 1%) and an interval of +-2.5% (its median half-width for identical code). Acceptance of
issue 59: a 16-commit range with a +10% slowdown at one commit is named in at most
ceil(log2 16) + 2 = 6 gate runs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from history.cli import bisect_main

STAND_IN_GATE = textwrap.dedent("""
    import argparse, hashlib, json, subprocess, sys
    from pathlib import Path
    p = argparse.ArgumentParser()
    p.add_argument("--against"); p.add_argument("--repo"); p.add_argument("--out")
    a = p.parse_args()
    git = lambda *x: subprocess.run(["git", "-C", a.repo, *x], capture_output=True, text=True, check=True).stdout
    head = git("rev-parse", "HEAD").strip()
    state = Path(__file__).with_name("state"); state.mkdir(exist_ok=True)
    tries = state / head
    tries.write_text(str(int(tries.read_text()) + 1 if tries.exists() else 1))
    if (Path(a.repo) / "broken.txt").exists():
        sys.exit("the candidate does not build")  # exit 1 and no gate.json: no figure
    if Path(__file__).with_name("flaky_once").exists() and tries.read_text() == "1":
        sys.exit(2)
    cost = float((Path(a.repo) / "cost.txt").read_text())
    base = float(git("show", f"{a.against}:cost.txt"))
    seed = Path(a.out).name[:8] + git("log", "-1", "--format=%s")  # "gate-NN-" and "commit i": the same every time
    rng = int(hashlib.sha256(seed.encode()).hexdigest()[:8], 16) / 16**8  # uniform in [0, 1)
    noise = 0.01 * 3**0.5 * (2 * rng - 1)  # sd 1%
    change = cost / base - 1 + noise
    check = {"metric": "cpu_ms_per_token", "baseline": base, "candidate": cost * (1 + noise), "change": change,
             "interval": [change - 0.025, change + 0.025], "verdict": "REGRESSION" if change - 0.025 > 0.05 else "ok",
             "rule": {"direction": "lower", "tolerance": 0.05, "kind": "time", "gate": True}}
    verdict = "fail" if check["verdict"] == "REGRESSION" else "pass"
    Path(a.out, "gate.json").write_text(json.dumps({"verdict": verdict, "baseline_commit": a.against, "pairs": 8,
                                                    "checks": [check], "elapsed_s": 0.1}))
    sys.exit(1 if verdict == "fail" else 0)
""")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def make_repo(tmp_path: Path, costs: list[float], broken: set[int] = frozenset()) -> tuple[Path, list[str]]:  # type: ignore[assignment]
    """A repo whose commit i has cost.txt = costs[i] (and broken.txt where i in `broken`); its shas."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    shas = []
    for i, cost in enumerate(costs):
        (repo / "cost.txt").write_text(f"{cost}\n")
        (repo / "src.txt").write_text(f"change {i}\n")
        if i in broken:
            (repo / "broken.txt").write_text("x\n")
        elif (repo / "broken.txt").exists():
            (repo / "broken.txt").unlink()
        _git(repo, "add", "-A")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"commit {i}")
        shas.append(_git(repo, "rev-parse", "HEAD"))
    return repo, shas


def _gate_cmd(tmp_path: Path) -> str:
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    script = tools / "stand_in_gate.py"
    script.write_text(STAND_IN_GATE)
    return f"{sys.executable} {script} --against {{good}} --repo {{repo}} --out {{out}}"


def _bisect(tmp_path: Path, repo: Path, good: str, bad: str, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "bisect"
    code = bisect_main([good, bad, "--repo", str(repo), "--out", str(out), "--gate-cmd", _gate_cmd(tmp_path),
                        "--explain-cmd", "echo explained {parent} {commit}", *extra])  # fmt: skip
    data = json.loads((out / "bisect.json").read_text()) if (out / "bisect.json").exists() else {}
    return code, data


@pytest.mark.parametrize("culprit", [1, 9, 15])
def test_a_ten_percent_slowdown_is_named_within_log2_plus_two_gate_runs(
        tmp_path: Path, culprit: int, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    costs = [2.0 if i < culprit else 2.2 for i in range(16)]
    repo, shas = make_repo(tmp_path, costs)
    head_before = _git(repo, "rev-parse", "HEAD")
    code, data = _bisect(tmp_path, repo, shas[0], shas[-1])
    out = capsys.readouterr().out
    assert code == 0, out
    assert data["first_bad"] == shas[culprit]
    assert data["gate_runs"] <= math.ceil(math.log2(16)) + 2
    assert f"first bad commit {shas[culprit]} (commit {culprit})" in out
    assert f"explained {shas[culprit - 1]} {shas[culprit]}" in out  # servelab-explain's answer, after the verdict
    assert data["step"]["worse"] == pytest.approx(0.10, abs=0.02) and data["threshold"] == pytest.approx(0.05, abs=0.01)
    assert all(s["seconds"] > 0 for s in data["steps"]) and "git bisect start" in data["log"]
    # the user's checkout untouched: same HEAD, no bisect in progress, the worktree gone
    assert _git(repo, "rev-parse", "HEAD") == head_before == shas[-1]
    assert len(_git(repo, "worktree", "list").splitlines()) == 1
    assert not (repo / ".git" / "BISECT_LOG").exists()


def test_no_slowdown_between_good_and_bad_is_said_and_nothing_is_bisected(tmp_path: Path) -> None:
    repo, shas = make_repo(tmp_path, [2.0] * 8)
    code, data = _bisect(tmp_path, repo, shas[0], shas[-1], "--retries", "1")
    assert code == 1 and data["first_bad"] is None
    assert data["gate_runs"] == 2  # an interval across 0 is inconclusive: measured once more, then given up


def test_an_inconclusive_commit_is_retried_then_skipped_never_guessed(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The culprit's parent never gives a figure: git is left with it and the culprit, and says so."""
    costs = [2.0 if i < 9 else 2.2 for i in range(16)]
    repo, shas = make_repo(tmp_path, costs, broken={8})
    code, data = _bisect(tmp_path, repo, shas[0], shas[-1], "--retries", "1")
    assert code == 3, capsys.readouterr().out
    assert data["first_bad"] is None and set(data["candidates"]) == {shas[8], shas[9]}
    runs_at_8 = [s for s in data["steps"] if s["commit"] == shas[8]]
    assert [s["attempt"] for s in runs_at_8] == [0, 1] and {s["verdict"] for s in runs_at_8} == {"inconclusive"}
    assert "git bisect skip" in data["log"]


def test_a_gate_that_fails_once_is_retried_and_the_answer_stands(tmp_path: Path) -> None:
    costs = [2.0 if i < 5 else 2.2 for i in range(16)]
    repo, shas = make_repo(tmp_path, costs)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "flaky_once").write_text("")
    code, data = _bisect(tmp_path, repo, shas[0], shas[-1])
    assert code == 0 and data["first_bad"] == shas[5]
    assert all(s["attempt"] in (0, 1) for s in data["steps"])
    assert sum(s["verdict"] == "inconclusive" for s in data["steps"]) == len({s["commit"] for s in data["steps"]})


def test_bisect_records_its_gate_runs_in_the_history(tmp_path: Path) -> None:
    from history.store import Store

    repo, shas = make_repo(tmp_path, [2.0 if i < 4 else 2.2 for i in range(8)])
    url = str(tmp_path / "h.sqlite")
    code, data = _bisect(tmp_path, repo, shas[0], shas[-1], "--history", url)
    assert code == 0
    with Store(url) as store:
        runs = store.runs()
    assert len(runs) == data["gate_runs"] and set(runs["kind"]) == {"gate"}
    assert set(runs["commit_sha"]) == {s["commit"] for s in data["steps"]}


def test_good_must_be_an_ancestor_of_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo, shas = make_repo(tmp_path, [2.0, 2.0, 2.2])
    code, _ = _bisect(tmp_path, repo, shas[-1], shas[0])
    assert code == 2 and "is not an ancestor" in capsys.readouterr().err
