"""The 2x2 sweep through `hydra/launcher=ray` on a local Ray cluster (issue 43 item 1).

Ray needs cloudpickle < 3, which the main .venv keeps at 3 (joblib declares >= 3), so the sweep
runs in the side venv `make ray-venv` makes (scripts/ray_venv.sh: Ray and the launcher over
.venv's packages). The launcher starts a head-only cluster: 2 CPUs, no dashboard, its files
under a temp dir of this test and auth mode off, so nothing lands in the home folder (HOME points
at an empty folder the test then checks). The sweep must equal the basic launcher's
(tests/launcher_sweep.py).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
from launcher_sweep import assert_same_sweep, basic_sweep, run_sweep

RAY_VENV = Path(os.environ.get("RAY_VENV", Path.home() / ".cache" / "servelab-ray"))


def _layered_on() -> str | None:
    """The main venv's site-packages the side venv reads (scripts/ray_venv.sh writes it in a .pth)."""
    for pth in RAY_VENV.glob("lib/python*/site-packages/zz_servelab_main_venv.pth"):
        text = pth.read_text()
        return text.split("addsitedir(", 1)[1].split(")", 1)[0].strip("'\"") if "addsitedir(" in text else None
    return None


def test_ray_sweep_equals_the_basic_launchers(tmp_path: Path) -> None:
    python = RAY_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"Ray's side venv {RAY_VENV} missing: `make ray-venv` makes it")
    layered = _layered_on()
    if layered != sysconfig.get_paths()["purelib"]:
        pytest.skip(f"Ray's side venv {RAY_VENV} reads another checkout's venv ({layered}), not this one's: "
                    "`make ray-venv` layers it on this one")
    home = tmp_path / "home"
    home.mkdir()
    # Ray's socket paths must stay under 107 bytes: a short folder, not pytest's deep tmp_path.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = dict(os.environ, HOME=str(home), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               MPLCONFIGDIR=str(tmp_path / "mpl"))  # matplotlib's font cache is not Ray's: kept out of HOME too
    basic, ray = basic_sweep(), tmp_path / "ray"
    try:
        out = run_sweep(ray, ["hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                              "+hydra.launcher.ray.init.include_dashboard=false",
                              f"+hydra.launcher.ray.init._temp_dir={ray_tmp}"], python=str(python), env=env)
        assert "Ray" in out or list(Path(ray_tmp).glob("session_*")), out[-2000:]  # a Ray session ran the jobs
        assert list(Path(ray_tmp).glob("session_*/logs")), "no Ray session under the test's temp dir"
        assert_same_sweep(ray, basic)
        assert not any(home.iterdir()), sorted(str(p) for p in home.rglob("*"))  # nothing in the home folder
        assert _ray_processes(ray_tmp) == [], "the sweep's Ray cluster outlived it"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _ray_processes(ray_tmp: str, wait_s: float = 10.0) -> list[int]:
    """Pids whose command line names the cluster's temp dir (raylet, GCS, workers) still alive after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if ray_tmp.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)
