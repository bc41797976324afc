"""Small C++ CPU kernels, compiled on first use with torch's `cpp_extension`.

torch caches the build in ~/.cache/torch_extensions (scripts/setup.sh builds them once);
this module keeps the loaded module per name. Where no C++ toolchain builds one, the
result is None and the caller runs its torch-ops fallback (correct, only slower).
"""

from __future__ import annotations

import logging
from types import ModuleType

logger = logging.getLogger(__name__)

_built: dict[str, ModuleType | None] = {}


def load_cpu_extension(name: str, source: str, what: str, extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module `name` of C++ `source` (OpenMP, -O3, native), or None if it cannot be built."""
    if name not in _built:
        try:
            from torch.utils.cpp_extension import load_inline

            _built[name] = load_inline(
                name=name,
                cpp_sources=[source],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch path is correct, just slower
            logger.warning("%s: C++ CPU kernels unavailable (%s); using torch ops", what, exc)
            _built[name] = None
    return _built[name]
