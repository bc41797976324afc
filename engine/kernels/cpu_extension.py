"""Small C++ CPU kernels, compiled on first use with torch's `cpp_extension`, registered as torch ops.

The sources live in engine/kernels/csrc/ (one file per kernel family, all including `kernel_header.h`,
the float / bfloat16 load-store helpers: kernels are templates over the storage type and
compute in float32). Each registers its kernels with `TORCH_LIBRARY_FRAGMENT(servelab, m)`, so
they are `torch.ops.servelab.<name>`: torch.profiler shows them by name and torch.compile traces
around them (each caller registers a fake implementation, see `register_fakes`).

torch caches a build in ~/.cache/torch_extensions under the extension's name (scripts/setup.sh
builds them once). The name carries a digest of the source with its headers, the compiler
flags, torch's version and this CPU's feature flags (the build is -march=native), so an edited
kernel, another checkout's kernel (the paired gate builds two commits side by side), another
torch or a home folder shared with another CPU never loads a stale or foreign build.

A finished build is loaded as it is (`torch.ops.load_library`) by any venv: torch's own loader
writes the venv's include paths into the build's ninja file, so a second venv (a fresh clone,
the gate's baseline venv) rebuilt the same kernels for a minute, and the first one rebuilt them
again after it. The `servelab-ready` stamp (READY_STAMP), written once a build loaded, names the
torch that built it.
Where no C++ toolchain builds one, the result is False and the caller runs its torch-ops
fallback (correct, only slower).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# SERVELAB_CPU_MARCH (a build override, not a behaviour switch): the `-march` the kernels are built
# for instead of this CPU's own (`native`), e.g. `x86-64-v3` to run the AVX2 paths on an AVX-512 or
# AMX machine (tests/test_csrc_targets.py does), `x86-64` for the scalar references alone. A target
# this CPU cannot run dies with an illegal instruction: name one it can.
MARCH_ENV = "SERVELAB_CPU_MARCH"


def cflags() -> tuple[str, ...]:
    """The compiler flags every kernel is built with (-march from MARCH_ENV, else native)."""
    return ("-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp")

_built: dict[str, bool] = {}


def translation_unit(source: str, seen: set[str] | None = None) -> str:
    """engine/kernels/csrc/`source` with its local `#include "..."` lines replaced by those files' text
    (each file once, as `#pragma once` asks): what is compiled, independent of where this
    checkout lives, so two checkouts of the same kernels share one cached build. `seen`: the
    files already expanded (shared across calls, every source in one unit: all_sources_unit)."""
    seen = set() if seen is None else seen

    def expand(name: str) -> list[str]:
        if name in seen:
            return []
        seen.add(name)
        out = []
        for line in (CSRC / name).read_text().splitlines():
            words = line.split()
            if words[:1] == ["#include"] and len(words) == 2 and words[1].startswith('"'):
                out += expand(words[1].strip('"'))
            elif words != ["#pragma", "once"]:
                out.append(line)
        return out

    return "\n".join(expand(source)) + "\n"


def all_sources_unit() -> str:
    """Every kernel source of engine/kernels/csrc in one translation unit (each header once): what
    tests/test_csrc_targets.py compiles for each instruction-set target in one compiler run."""
    seen: set[str] = set()
    return "".join(translation_unit(p.name, seen) for p in sorted(CSRC.glob("*.cpp")))


def extension_name(source: str, extra_cflags: tuple[str, ...] = (), unit: str | None = None) -> str:
    """`servelab_<stem>_<digest>`: the digest covers what the build depends on (module note);
    `unit`: `translation_unit(source)` where the caller has it already."""
    import torch

    from engine.kernels.isa import cpu_flags

    digest = hashlib.sha256()
    flags = " ".join((*cflags(), *extra_cflags))
    for part in (unit if unit is not None else translation_unit(source), flags, torch.__version__, " ".join(sorted(cpu_flags()))):
        digest.update(part.encode())
        digest.update(b"\0")
    return f"servelab_{Path(source).stem}_{digest.hexdigest()[:12]}"


def _build_folder(name: str) -> Path:
    """torch's build folder for the extension `name` (made if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


# Two locks guard a build folder. torch's own (`<folder>/lock`, torch.utils.file_baton) is a file
# made with O_CREAT | O_EXCL and removed when the build ends: it records no owner, and a waiter
# spins on it forever when a killed build left it. Ours (`<folder>.owner`, beside the folder so it
# survives a clean-up) is an fcntl lock the building process holds from before torch's is taken
# until the build is stamped ready; the kernel drops it when that process dies, and the file
# records the holder's pid. So, holding ours, a torch lock still there was not made by a live
# servelab build: either a killed build left it, or a build that does not take ours holds it (an
# older checkout's, or torch's `load` called directly). torch's baton keeps its file open for the
# whole build, so the second case shows as a process with the file open (`_lock_holders`); only a
# lock nobody holds is stale, however old or young it is.
OWNER_SUFFIX = ".owner"


@contextmanager
def _build_owner(name: str, folder: Path) -> Iterator[None]:
    """Hold the exclusive build lock of `folder` (waiting while a live process holds it) and record
    this process's pid in it; released on exit, and by the kernel if this process dies."""
    import fcntl

    path = folder.with_name(folder.name + OWNER_SUFFIX)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s: waiting for the build by pid %s (%s)", name, _recorded_pid(fd) or "?", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _recorded_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or "x")
    except (OSError, ValueError):
        return None


def _lock_holders(lock: Path) -> list[int] | None:
    """Pids of the processes that have `lock` open (Linux /proc); None when that cannot be told
    (no /proc, or the file belongs to another user, whose processes this one cannot read)."""
    try:
        st = lock.stat()
    except OSError:
        return []
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir() or (st.st_uid != os.geteuid() and os.geteuid() != 0):
        return None
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != st.st_uid:
                continue
            for fd in (entry / "fd").iterdir():
                try:
                    target = fd.stat()
                except OSError:
                    continue
                if (target.st_dev, target.st_ino) == (st.st_dev, st.st_ino):
                    holders.append(int(entry.name))
                    break
        except OSError:  # the process ended meanwhile
            continue
    return holders


def _clear_stale_lock(name: str, folder: Path | None = None) -> None:
    """Called holding `_build_owner`: a torch build lock that no live process holds was left by a
    killed build (torch would wait on it forever); it goes with the half-built folder, so the
    next build starts clean. A lock some process holds open is a live build: left alone, however
    old (a slow build on a loaded machine takes many minutes)."""
    import shutil
    import time

    folder = folder or _build_folder(name)
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    holders = _lock_holders(lock)
    if holders is None:
        logger.warning("%s: the build lock %s (%.0f s old) belongs to another user; waiting for it (remove it "
                       "if no build is running)", name, lock, age)
        return
    if holders:
        logger.info("%s: a build by pid %s holds %s (%.0f s); waiting for it", name,
                    ",".join(map(str, holders)), lock, age)
        return
    logger.warning("%s: removing a build lock left %.0f s ago by an interrupted build", name, age)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)


READY_STAMP = "servelab-ready"


def _load_prebuilt(name: str, folder: Path) -> bool:
    """Load the finished build of `name` in `folder` without torch's build step (module note);
    False when there is none stamped ready by this torch, or it does not load (then it is built
    again)."""
    import torch

    library = folder / f"{name}.so"
    try:
        if (folder / READY_STAMP).read_text() != torch.__version__ or not library.is_file():
            return False
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("%s: the cached build did not load (%s); building it again", name, exc)
        return False
    return True


def _stamp_ready(name: str, folder: Path) -> None:
    import torch

    if (folder / f"{name}.so").is_file():
        tmp = folder / f"{READY_STAMP}.{os.getpid()}"
        tmp.write_text(torch.__version__)
        tmp.replace(folder / READY_STAMP)  # atomic: a reader sees no stamp or a whole one


def is_loaded(source: str) -> bool:
    """Whether `source`'s ops are loaded in this process (a build that failed, or none yet: False)."""
    return _built.get(source, False)


def load_cpu_ops(
    source: str, what: str, register_fakes: Callable[[], None], extra_cflags: tuple[str, ...] = (),
    instead: str = "using torch ops",
) -> bool:  # fmt: skip
    """Build and load engine/kernels/csrc/`source` (OpenMP, -O3, native), which registers `torch.ops.servelab.*`.

    `register_fakes` then registers the ops' fake (meta) implementations. True when loaded;
    False (once logged, with `instead`: what runs in their place) where it cannot be built.
    """
    if source not in _built:
        try:
            from torch.utils.cpp_extension import load_inline

            unit = translation_unit(source)
            name = extension_name(source, extra_cflags, unit)
            folder = _build_folder(name)
            if not _load_prebuilt(name, folder):
                with _build_owner(name, folder):
                    # another process may have finished the build while this one waited for it
                    if not _load_prebuilt(name, folder):
                        _clear_stale_lock(name, folder)
                        load_inline(  # the text, not the path: the build command is the same from any checkout
                            name=name,
                            cpp_sources=[unit],
                            extra_cflags=[*cflags(), *extra_cflags],
                            extra_ldflags=["-fopenmp"],
                            is_python_module=False,
                            verbose=False,
                        )
                        _stamp_ready(name, folder)
            register_fakes()
            _built[source] = True
        except Exception as exc:  # no compiler, no headers: the torch path is correct, just slower
            logger.warning("%s: C++ CPU kernels unavailable (%s); %s", what, exc, instead)
            _built[source] = False
    return _built[source]
