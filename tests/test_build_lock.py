"""A live kernel build is never deleted; a dead one's folder is (issue 60 item 4).

engine/kernels/cpu_extension.py used to remove a build folder whose torch lock was older than 600 s, and
to keep a younger one: a slow build on a loaded machine lost its folder under it, and a build
killed a minute ago left every later one waiting on torch's lock. Here the builders are real
processes: one runs `load_cpu_ops` with a build that waits for the test's word (torch's baton
taken as torch takes it), one takes only torch's baton (a checkout without the owner lock).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.kernels import cpu_extension

SOURCE = sorted(cpu_extension.CSRC.glob("*.cpp"))[0].name

# mode "servelab": load_cpu_ops with a build that holds torch's lock until GO exists;
# mode "torch": torch's lock taken directly (no owner lock), held until GO exists.
_BUILDER = """
import os, sys, time
from pathlib import Path
import torch.utils.cpp_extension as ce
from torch.utils.file_baton import FileBaton
from engine.kernels import cpu_extension
mode, source, go = sys.argv[1:4]

def slow_build(name, **_):
    folder = cpu_extension._build_folder(name)
    baton = FileBaton(str(folder / "lock"))
    assert baton.try_acquire()
    (folder / "half-built.o").write_text("x")
    print("building", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    baton.release()

if mode == "servelab":
    ce.load_inline = slow_build
    cpu_extension.load_cpu_ops(source, "test", lambda: None)
else:
    slow_build(cpu_extension.extension_name(source))
"""


@pytest.fixture
def ext_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_extension, "_built", {})
    return tmp_path


def _builder(mode: str, go: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, mode, SOURCE, str(go)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "building", f"builder exited {proc.wait()}"
    return proc


def _folder() -> Path:
    return cpu_extension._build_folder(cpu_extension.extension_name(SOURCE))


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _record_builds(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bool]]:
    """Replace torch's build in this process by one that records what the folder held."""
    import torch.utils.cpp_extension as ce

    seen: list[dict[str, bool]] = []

    def build(name: str, **_: object) -> None:
        folder = cpu_extension._build_folder(name)
        seen.append({"half_built": (folder / "half-built.o").exists(), "lock": (folder / "lock").exists()})

    monkeypatch.setattr(ce, "load_inline", build)
    return seen


def test_an_old_lock_of_a_live_build_is_never_deleted(ext_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    go = ext_dir / "go"
    proc = _builder("servelab", go)
    try:
        folder = _folder()
        _age(folder / "lock", 3600)  # an hour-long build on a loaded machine
        seen = _record_builds(monkeypatch)
        second = threading.Thread(target=cpu_extension.load_cpu_ops, args=(SOURCE, "test", lambda: None))
        second.start()
        time.sleep(2.0)
        # the second process waits for the first; the first one's folder is untouched
        assert (folder / "half-built.o").exists() and (folder / "lock").exists()
        assert seen == [] and second.is_alive()
        owner = folder.with_name(folder.name + cpu_extension.OWNER_SUFFIX)
        assert owner.read_text().strip() == str(proc.pid)  # the builder's pid is recorded
        go.touch()
        assert proc.wait(30) == 0
        second.join(30)
        assert seen == [{"half_built": True, "lock": False}]  # it built after the first, in its folder
    finally:
        go.touch()
        proc.kill()
        proc.wait()


def test_an_old_lock_held_by_a_build_without_the_owner_lock_is_kept(
    ext_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = ext_dir / "go"
    proc = _builder("torch", go)  # e.g. an older checkout of the paired gate building the same kernels
    try:
        folder = _folder()
        _age(folder / "lock", 3600)
        seen = _record_builds(monkeypatch)
        cpu_extension.load_cpu_ops(SOURCE, "test", lambda: None)
        assert seen == [{"half_built": True, "lock": True}]  # torch's own wait takes over from here
        assert cpu_extension._lock_holders(folder / "lock") == [proc.pid]
    finally:
        go.touch()
        proc.wait(30)


@pytest.mark.parametrize("age_s", [5.0, 3600.0])
def test_a_dead_builders_folder_is_cleaned(ext_dir: Path, monkeypatch: pytest.MonkeyPatch, age_s: float) -> None:
    proc = _builder("servelab", ext_dir / "go")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder = _folder()
    _age(folder / "lock", age_s)  # young or old: its owner is gone, torch would wait on it forever
    seen = _record_builds(monkeypatch)
    assert cpu_extension.load_cpu_ops(SOURCE, "test", lambda: None)
    assert seen == [{"half_built": False, "lock": False}]
