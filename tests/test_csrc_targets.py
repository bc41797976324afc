"""Every kernel path of engine/kernels/csrc compiles for every CPU class, whatever CPU runs the tests.

The kernels choose their paths at compile time (`#if defined(__AVX512BF16__)`, `__AMX_TILE__`,
`__AVX2__`, ...), so a machine's own `-march=native` build compiles one set of branches and never
sees the others: an edit could break the AVX-512 path unseen on an AVX2 runner, or the AVX2 path on
an AMX developer machine. Here all sources, as one translation unit, go through the compiler's
checks (`-fsyntax-only`: parsed, templates instantiated, no code generated) for:
- `x86-64`: no vector flags, the scalar references (what an ARM build compiles besides its own);
- `x86-64-v3`: AVX2 + FMA + F16C, the hosted CI runners' and most laptops' class;
- `cooperlake`: AVX-512 with BF16 and VNNI, no AMX (the class of AMD Zen 4, which GCC 12 cannot name);
- `sapphirerapids`: AVX-512 BF16 / VNNI and AMX.
A target that passed for the exact same text, flags and compiler is remembered under
~/.cache/servelab/csrc-targets (the check is deterministic in those), so an unchanged tree does not
pay the ~35 s of CPU per target again.

Then the numeric tests of the AVX2 paths run on the AVX2 build (SERVELAB_CPU_MARCH=x86-64-v3) in a
process of their own, where this CPU has AVX-512 (there its native build takes other paths).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.kernels.cpu_extension import MARCH_ENV, all_sources_unit
from engine.kernels.isa import cpu_flags

TARGETS = ("x86-64", "x86-64-v3", "cooperlake", "sapphirerapids")
CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) to check the kernel sources with")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "servelab" / "csrc-targets"


def _compile_command(march: str, source: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    return [CXX or "g++", "-std=c++17", "-fsyntax-only", f"-march={march}", "-fopenmp", "-O0",
            "-DTORCH_EXTENSION_NAME=servelab_check", *(f"-isystem{p}" for p in includes), str(source)]  # fmt: skip


def _check(march: str, unit: str, tmp: Path) -> tuple[str, int, str]:
    """(march, return code, the compiler's last lines); 0 from the cache where this text passed."""
    version = subprocess.run([CXX or "g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    key = hashlib.sha256("\0".join((unit, march, version)).encode()).hexdigest()[:24]
    stamp = CACHE / f"{march}-{key}.ok"
    if stamp.is_file():
        return march, 0, "(passed before for this exact text)"
    source = tmp / f"all_{march}.cpp"
    source.write_text(unit)
    done = subprocess.run(_compile_command(march, source), capture_output=True, text=True)
    if done.returncode == 0:
        CACHE.mkdir(parents=True, exist_ok=True)
        stamp.write_text(march)
    return march, done.returncode, "\n".join(done.stderr.splitlines()[-30:])


def test_every_kernel_path_compiles_for_every_cpu_class(tmp_path: Path) -> None:
    unit = all_sources_unit()
    # the branches each target must reach, so a target that silently compiled none of them fails
    for guard in ("__AVX512BF16__", "__AMX_TILE__", "SERVELAB_BLOCKS_AVX2", "__AVX2__"):
        assert guard in unit
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda m: _check(m, unit, tmp_path), TARGETS))
    failed = [f"-march={m}:\n{err}" for m, rc, err in results if rc != 0]
    assert not failed, "engine/kernels/csrc does not compile for:\n" + "\n".join(failed)


AVX2_TESTS = ("tests/test_cpu_blocks.py", "tests/test_cpu_kernels.py", "tests/test_cpu_gemv.py",
              "tests/test_block_layers.py")  # the last: the team step, which an AVX-512 build does not compile


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="the AVX2 build needs avx2, fma and f16c")
@pytest.mark.skipif("avx512f" not in cpu_flags(),
                    reason="no avx512f here: this CPU's native build is the AVX2 build, which the suite itself tests")
def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_machine() -> None:
    env = {**os.environ, MARCH_ENV: "x86-64-v3", "SERVELAB_CPU_AMX": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *AVX2_TESTS],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).parent.parent, timeout=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
