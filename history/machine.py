"""Where and on what a result was measured: the machine's fingerprint, the versions, the commit.

A series of one metric is only comparable with itself on one kind of CPU: the fingerprint is
a digest of the CPU model and its feature flags (what decides which kernels run), not of the
host name, so two CI runners of the same instance type share a series and a runner that moved
to another CPU generation starts a new one. Read here without importing torch or the engine.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Machine:
    cpu_model: str
    cpu_flags: tuple[str, ...]  # sorted
    cores: int
    arch: str

    @property
    def fingerprint(self) -> str:
        """12 hex digits: the CPU model, architecture and flags (never the host name)."""
        text = "\n".join([self.arch, self.cpu_model, " ".join(self.cpu_flags)])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def this_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> Machine:
    """The CPU of this machine from /proc/cpuinfo (platform's names where there is none)."""
    model, flags, cores = "", "", 0
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:  # x86, arm
                flags = value
            elif key == "processor":
                cores += 1
    except OSError:
        pass
    return Machine(model or platform.processor() or "unknown", tuple(sorted(set(flags.split()))),
                   cores, platform.machine())  # fmt: skip


def versions() -> dict[str, str]:
    """torch's, the engine's (this package's distribution) and Python's versions."""
    out = {"python": platform.python_version()}
    for name, dist in (("torch", "torch"), ("engine", "servelab")):
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def git(repo: Path, *args: str, check: bool = True) -> str:
    """`git -C repo ARGS`'s stdout, stripped; raises CalledProcessError when check and it fails."""
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)
    return proc.stdout.strip()


@dataclass(frozen=True, slots=True)
class Commit:
    sha: str
    time: float  # committer time, seconds since the epoch (orders a series where git cannot)
    subject: str
    dirty: bool = False  # the checkout had uncommitted changes to tracked files


def commit_info(repo: Path, ref: str = "HEAD", check_dirty: bool = True) -> Commit:
    """The commit `ref` names in `repo` (and whether the checkout differs from it)."""
    sha = git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}")
    when, _, subject = git(repo, "show", "-s", "--format=%ct %s", sha).partition(" ")
    dirty = bool(check_dirty and ref == "HEAD" and git(repo, "status", "--porcelain", "--untracked-files=no"))
    return Commit(sha, float(when), subject, dirty)


def branch_of(repo: Path) -> str:
    """The checkout's branch name ('' when detached or not a git checkout)."""
    try:
        name = git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return ""
    return "" if name == "HEAD" else name
