"""CPU tensors backed by transparent huge pages (2 MiB), for the paged KV cache.

Decode attention reads each request's cache blocks (a few KiB each, scattered over the whole
cache) once per layer and step: with 4 KiB pages nearly every block read starts with a TLB
miss. Linux backs anonymous memory with 2 MiB pages where the process asks for them
(`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the common default) or always
(`always`). `zeros_huge` maps fresh anonymous memory for a tensor whose storage starts on a
2 MiB boundary, marks it `MADV_HUGEPAGE` before the first touch, then zeroes it: the pages fault in as huge pages.
Measured on SmolLM2's cold-cache decode (benchmarks/cpu_paged_attention.py --layers 30,
bfloat16, 2 threads): 3-5% faster per layer. Elsewhere (no Linux, THP `never`, a GPU, a
failed `madvise`) it is `torch.zeros`: the same values, only 4 KiB pages.

Faulting huge pages in is slow in some VMs: a 1 GiB KV cache took 1.2-3.1 s on a 2-core KVM
guest (Zen 4) where `torch.zeros` took 0.45 s. `zeros_huge_in_background` therefore touches
them on a thread of its own (a plain memset, no OpenMP team) while the engine loads and
packs its weights: the caller collects the tensors when it needs them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def thp_mode() -> str:
    """The selected THP mode (`always`, `madvise`, `never`), or "" where there is none."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return ""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    libc.memset.restype = ctypes.c_void_p
    return libc


@functools.cache
def _madvise():  # type: ignore[no-untyped-def]
    fn = _libc().madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`, its storage in huge pages where the OS
    gives them (module note). The tensor is contiguous and views a slightly larger buffer."""
    return _advised_empty(shape, dtype, device).zero_()  # the first touch faults the pages in


class PendingZeros:
    """Tensors of zeros whose pages a background thread is faulting in (`zeros_huge_in_background`)."""

    def __init__(self, tensors: list[torch.Tensor], zeroed: bool = False) -> None:
        """`tensors`: uninitialised CPU tensors to zero on the thread, or (`zeroed`) zeros already."""
        self._tensors = tensors
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if not zeroed:
            self._thread = threading.Thread(target=self._fill, name="servelab-prefault", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        try:
            memset = _libc().memset
            for t in self._tensors:  # ctypes drops the GIL for the call: the loader keeps running
                memset(t.data_ptr(), 0, t.numel() * t.element_size())
        except BaseException as exc:  # handed to result()
            self._error = exc

    def result(self) -> list[torch.Tensor]:
        """The tensors, all zero, once the thread is done (its error, if it failed)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tensors


def zeros_huge_in_background(
    shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device | str = "cpu"
) -> PendingZeros:
    """`count` tensors as `zeros_huge(shape, dtype, device)` gives them, collected by `result()`:
    on a CPU zeroed (and so faulted in) on a background thread meanwhile (module note), on a GPU
    made at once."""
    if torch.device(device).type != "cpu":
        return PendingZeros([torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)], zeroed=True)
    return PendingZeros([_advised_empty(shape, dtype, device) for _ in range(count)])


def _advised_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor whose whole 2 MiB pages are marked `MADV_HUGEPAGE` before
    anything touches them (else `torch.empty`): whatever writes it first faults them in as huge pages."""
    device = torch.device(device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not sys.platform.startswith("linux") or thp_mode() != "madvise" or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)  # `always` needs no advice; `never` takes none
    # A mapping of its own, not malloc's: malloc serves even a large buffer from heap memory that
    # earlier frees left behind, already faulted in 4 KiB pages where the advice changes nothing
    # (seen: a 64 MiB buffer from [heap], no huge page, after an engine was freed in the process).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped with the tensor
    offset = -raw.data_ptr() % HUGE_PAGE
    start = raw.data_ptr() + offset
    length = nbytes - nbytes % HUGE_PAGE  # whole huge pages only; the tail keeps small pages
    if _madvise()(start, length, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): 4 KiB pages", ctypes.get_errno())
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def copies_on_huge_pages(tensors: Sequence[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors`, laid end to end (each on an `align`-byte boundary) in
    one huge-page buffer (written once, by the copies): a model's decode weights, streamed from memory at every step, then
    cross a 2 MiB page where they crossed 512 small ones (one page walk where there were 512).
    Where huge pages are not given the copies still share one buffer, in 4 KiB pages."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    arena = _advised_empty((max(total, 1),), torch.uint8)
    out = []
    for t, off, n in zip(tensors, offsets, sizes, strict=True):
        view = arena[off : off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out
