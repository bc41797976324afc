"""Huge-page-backed CPU tensors (engine/hugepages.py): the KV cache and the decode kernels' weights."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from engine import hugepages
from engine.hugepages import HUGE_PAGE, copies_on_huge_pages, thp_mode, zeros_huge, zeros_huge_in_background


def test_zeros_huge_is_zeros_of_the_shape() -> None:
    for shape, dtype in (((3, 5), torch.float32), ((HUGE_PAGE // 2 + 7,), torch.bfloat16), ((2, HUGE_PAGE // 4),
                                                                                               torch.int32)):
        t = zeros_huge(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


def test_zeros_in_background_are_zeros_of_the_shape_each_its_own() -> None:
    """The KV cache's allocation: `count` tensors as zeros_huge gives them, zeroed on a thread
    (over memory that held garbage: 0xff written first through a buffer freed just before)."""
    shape, dtype = (2, 300, 16, 3, 64), torch.bfloat16  # 3.5 MiB each: advised huge pages where THP allows
    garbage = torch.full((64 << 20,), -1, dtype=torch.uint8)
    del garbage
    pending = zeros_huge_in_background(shape, dtype, 3)
    tensors = pending.result()
    assert len(tensors) == 3 and pending.result() == tensors  # collected twice: the same tensors
    for t in tensors:
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    tensors[0].fill_(1)
    assert not tensors[1].any() and not tensors[2].any()


def test_a_failed_background_fill_is_raised_by_result(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLibc:
        @property
        def memset(self):  # type: ignore[no-untyped-def]
            raise OSError("no memset here")

    monkeypatch.setattr(hugepages, "_libc", lambda: NoLibc())
    pending = zeros_huge_in_background((4, 1024), torch.float32, 2)
    with pytest.raises(OSError, match="no memset here"):
        pending.result()


def test_copies_share_one_buffer_keep_values_and_stand_alone() -> None:
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(37, 11, generator=g).bfloat16(), torch.randint(-9, 9, (5, 2, 16), generator=g, dtype=torch.int32),
           torch.randn(3, generator=g), torch.randn(700, 800, generator=g).bfloat16()]
    out = copies_on_huge_pages(src)
    base = out[0].untyped_storage().data_ptr()
    for a, b in zip(src, out, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous()
        assert torch.equal(a, b)
        assert b.untyped_storage().data_ptr() == base  # one buffer
        assert b.data_ptr() % 64 == 0  # each on a cache line
    ends = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in out)
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:], strict=False))  # no overlap
    src[3].zero_()
    assert out[3].any()  # copies, not views of the sources


def _huge_kib_at(addr: int) -> int | None:
    """AnonHugePages (KiB) of the mapping that holds `addr` (/proc/self/smaps), None where unknown.
    The mapping's own figure: the process's total moves with whatever else is freed meanwhile (a
    previous test's engine, collected during the copy, once cancelled a fresh 64 MiB exactly)."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() != "madvise",
                    reason="needs Linux transparent huge pages in `madvise` mode")
def test_copies_lie_on_huge_pages_where_the_kernel_gives_them() -> None:
    # 64 MiB, as a previous test's engine left the heap with more than that free (and faulted in 4
    # KiB pages), where a malloc'ed buffer never got a huge page: the buffer must be a mapping of its own
    out = copies_on_huge_pages([torch.ones(32 * HUGE_PAGE // 2, dtype=torch.bfloat16)])
    assert bool(out[0].eq(1).all())
    got = _huge_kib_at(out[0].data_ptr())
    if got is None:
        pytest.skip("no AnonHugePages for the buffer's mapping in /proc/self/smaps")
    if got >= HUGE_PAGE // 1024:  # at least one 2 MiB page
        return
    # None: either the copies missed the advice, or the kernel had no 2 MiB page to give just now
    # (a busy or fragmented machine). A fresh mapping advised and touched the plain way tells them apart.
    if not _kernel_gives_huge_pages_now():
        pytest.skip("the kernel gave no huge page to a fresh MADV_HUGEPAGE mapping either (memory fragmented or busy)")
    raise AssertionError(f"no huge page for the copies ({got} kB) where a plain mapping got some")


def _kernel_gives_huge_pages_now() -> bool:
    import ctypes
    import mmap

    m = mmap.mmap(-1, 16 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        for off in range(0, len(m), 4096):
            m[off] = 1
        view = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(view)
        del view  # the mapping can close again
        return (_huge_kib_at(addr) or 0) >= HUGE_PAGE // 1024
    finally:
        m.close()


def test_planned_decode_weights_lie_in_one_buffer() -> None:
    """Where the decode-sized bf16 kernels run (AMX or AVX512-BF16), prepack moves every layer's
    packed matrices and the LM head into one huge-page buffer; the greedy tokens are those of
    the same weights in their own tensors (the kernels read the same words)."""
    from engine.frontend.llm import LLM
    from engine.kernels import amx_linear

    if not amx_linear.available():
        pytest.skip("the CPU has neither AMX nor AVX512-BF16 (or no C++ toolchain): no decode-sized kernels")
    llm = LLM(model="smollm2", load_format="dummy", num_layers_override=2, dtype="bfloat16", num_blocks=32,
              max_num_seqs=2)
    model = llm.engine_core.executor.worker.model  # type: ignore[attr-defined]
    plan = model.model.plan
    assert plan is not None and plan.amx_ops is not None
    packs = [t for lp in plan.layers for t in (lp.amx.qkv, lp.amx.o, lp.amx.gate_up, lp.amx.down)]
    storages = {t.untyped_storage().data_ptr() for t in [*packs, model.amx_lm_head]}
    assert len(storages) == 1
    from engine.kernels.forward_plan import AmxPacks

    def own_tensors() -> None:
        own = [AmxPacks(*(t.clone() for t in (lp.amx.qkv, lp.amx.o, lp.amx.gate_up, lp.amx.down))) for lp in plan.layers]
        model.model.plan = dataclasses.replace(plan, layers=tuple(
            dataclasses.replace(lp, amx=p) for lp, p in zip(plan.layers, own, strict=True)))
        model.amx_lm_head = model.amx_lm_head.clone()

    moved, alone = _tokens_before_and_after(llm, own_tensors)
    assert moved == alone and all(len(t) == 5 for t in moved)


def _tokens_before_and_after(llm, change) -> tuple[list, list]:  # type: ignore[no-untyped-def]
    """Greedy tokens of two prompts (one short, one of 20 tokens), then again after `change()`."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[3, 4, 5, 6], [9] * 20]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    change()
    llm.reset_prefix_cache()
    return before, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_quant_packs_and_head_join_the_buffer() -> None:
    """With the checkpoint's blocks (model.quantized_decode, the default), prepack moves each
    layer's quant packs and the quantized LM head into the same huge-page buffer as the bfloat16
    packs (a batch-1 step streams them; on 4 KiB pages it read at half the bandwidth); the greedy
    tokens are those of the same packs in tensors of their own."""
    from engine.frontend.llm import LLM
    from engine.kernels import amx_linear

    if not amx_linear.quant_available():
        pytest.skip("no block kernels here (they need AVX512-BF16 and a C++ toolchain)")
    llm = LLM(model="smollm2", num_layers_override=2, dtype="bfloat16", num_blocks=32, max_num_seqs=2)
    model = llm.engine_core.executor.worker.model  # type: ignore[attr-defined]
    plan = model.model.plan
    assert plan is not None and plan.quant and model.quant_lm_head is not None
    quant = [t for lp in plan.layers for t in lp.amx.quant]
    bf16 = [t for lp in plan.layers for t in lp.amx.matrices(False)]
    storages = {t.untyped_storage().data_ptr() for t in [*quant, *bf16, model.quant_lm_head, model.amx_lm_head]}
    assert len(storages) == 1

    def own_tensors() -> None:
        model.model.plan = dataclasses.replace(plan, layers=tuple(
            dataclasses.replace(lp, amx=dataclasses.replace(lp.amx, quant=tuple(t.clone() for t in lp.amx.quant)))
            for lp in plan.layers))  # fmt: skip
        model.quant_lm_head = model.quant_lm_head.clone()

    moved, alone = _tokens_before_and_after(llm, own_tensors)
    # the plan's flat lists follow its layers: the single-call layers read the copies
    assert not {t.untyped_storage().data_ptr() for t in model.model.plan.quant_packs} & storages
    assert moved == alone and all(len(t) == 5 for t in moved)
