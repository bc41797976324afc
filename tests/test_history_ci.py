"""The CI wiring of the performance history: .github/workflows/perf.yml parses and every command it
runs exists (make targets, console scripts, servelab-history's subcommands and options), and .ci/run
installs PostgreSQL for the store's tests before `make test`."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from history.cli import history_parser

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "perf.yml"
FAKE_ENV = {"$HISTORY_URL": "runs/history/history.sqlite", "$GATE_JSON": "runs/ci_gate/paired/gate.json",
            "$GITHUB_STEP_SUMMARY": "/tmp/summary.md", "$PR": "1"}  # fmt: skip


def _workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def _commands(step: dict) -> list[list[str]]:
    """The simple commands of a step's run script (split on ||, &&, ; and lines), $VARs filled in."""
    out = []
    for line in step.get("run", "").splitlines():
        for part in re.split(r"\|\||&&|;", line):
            part = part.strip()
            for var, value in FAKE_ENV.items():
                part = part.replace(f'"{var}"', value).replace(var, value)
            if part:
                out.append(shlex.split(part))
    return out


def _steps() -> list[dict]:
    return _workflow()["jobs"]["gate"]["steps"]


def test_the_workflow_gates_pull_requests_and_records_on_main() -> None:
    wf = _workflow()
    assert "pull_request" in wf["on"] and wf["on"]["push"]["branches"] == ["main"]
    steps = {s.get("name", s.get("uses")): s for s in _steps()}
    gate = steps["Paired gate (this commit against the merge-base with main; on main, HEAD~1)"]
    assert _commands(gate) == [["make", "gate"]]
    record = next(s for s in _steps() if "record" in s.get("run", ""))
    assert "github.event_name == 'push'" in record["if"]
    upload = next(s for s in _steps() if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert "runs/history/report.html" in upload["with"]["path"]
    assert any("GITHUB_STEP_SUMMARY" in s.get("run", "") for s in _steps())
    assert any("gh pr comment" in s.get("run", "") for s in _steps())
    checkout = next(s for s in _steps() if str(s.get("uses", "")).startswith("actions/checkout"))
    assert checkout["with"]["fetch-depth"] == 0  # the gate needs the baseline commit


def test_every_command_of_the_workflow_exists() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    seen = 0
    for step in _steps():
        if "uses" in step:
            assert re.fullmatch(r"[\w-]+/[\w-]+(/[\w-]+)*@v\d+", step["uses"]), step["uses"]
        for cmd in _commands(step):
            seen += 1
            if cmd[0] == "make":
                assert set(cmd[1:]) <= targets, cmd
            elif cmd[0].startswith(".venv/bin/"):
                name = cmd[0].removeprefix(".venv/bin/")
                assert name in scripts, f"{name}: no such console script in pyproject.toml"
                if name == "servelab-history":
                    history_parser().parse_args(cmd[1:])  # its subcommand and options exist (exits 2 if not)
            elif cmd[0] == "gh":
                assert cmd[1:3] == ["pr", "comment"]
            elif cmd[0] == "exit":
                pass
            else:
                pytest.fail(f"a command the test does not know: {cmd}")
    assert seen >= 6


def test_ci_installs_postgres_before_the_tests() -> None:
    lines = [ln.split("#")[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert lines.index("bash scripts/install_postgres.sh") < lines.index("make test")
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install_postgres.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "exit 0" in (ROOT / "scripts" / "install_postgres.sh").read_text()  # never fails CI itself
