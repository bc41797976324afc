"""The fused C++ CPU ops (`torch.ops.servelab.*`) against float32 torch references, in float32 and bfloat16.

Tolerances: float32 1e-5 (same arithmetic, other summation order). bfloat16: the kernels compute
in float32 and round once per output, the reference computes in float32 from the same bfloat16
inputs and rounds once, so they differ by at most ~1 bfloat16 ulp (2^-8 relative): rtol 1e-2,
atol 1e-2. The layers' torch-ops fallback is checked against the same references.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_kernels import kernels
from engine.kernels.paged_attention import paged_attention_op, set_amx_attention
from engine.model import layers

pytestmark = pytest.mark.skipif(
    kernels() is None or paged_attention_op() is None, reason="no C++ toolchain: the CPU ops are not built"
)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Within the test body, call the layers with the fallback via `torch_ops()`."""

    def run(fn):  # type: ignore[no-untyped-def]
        with monkeypatch.context() as m:
            m.setattr(layers, "kernels", lambda: None)
            return fn()

    return run


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rms_norm_and_fused_residual_add(dtype, torch_ops) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    norm = layers.RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, res = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
    torch.testing.assert_close(norm(x), _rms_ref(x, norm.weight, 1e-5), **TOL[dtype])
    want_res = (x.float() + res.float()).to(dtype)
    want_out = _rms_ref(want_res, norm.weight, 1e-5)
    got_out, got_res = norm.add_norm_(x.clone(), res.clone())
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # one rounding of an exact sum
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])
    fb_out, fb_res = torch_ops(lambda: norm(x, res))
    torch.testing.assert_close(fb_out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rope_in_place_on_the_first_heads(dtype, torch_ops) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    rope = layers.RotaryEmbedding(64, 256, 10000.0)
    rope.rebuild(dtype=dtype)
    qkv = torch.randn(5, 9 + 3 + 3, 64).to(dtype)  # q heads, k heads, v heads of a fused projection
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 17, 100, 255]))
    x = qkv[:, :12].float()
    swapped = torch.cat((x[..., 32:], x[..., :32]), dim=-1)
    want = (x * cos.float() + swapped * sin.float()).to(dtype)
    got = layers.RotaryEmbedding.rotate_heads_(qkv.clone(), 12, cos, sin)
    torch.testing.assert_close(got[:, :12], want, **TOL[dtype])
    assert torch.equal(got[:, 12:], qkv[:, 12:])  # v heads untouched
    fallback = torch_ops(lambda: layers.RotaryEmbedding.rotate_heads_(qkv.clone(), 12, cos, sin))
    torch.testing.assert_close(fallback[:, :12], want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_silu_mul(dtype, torch_ops) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    gate_up = (torch.randn(6, 160) * 3).to(dtype)
    gate, up = gate_up.float().split(80, dim=-1)
    want = (F.silu(gate) * up).to(dtype)
    torch.testing.assert_close(kernels().silu_mul(gate_up), want, **TOL[dtype])
    mlp = layers.GatedMLP(32, 80).to(dtype)
    x = torch.randn(6, 32).to(dtype)
    torch.testing.assert_close(mlp(x), torch_ops(lambda: mlp(x)), **TOL[dtype])


def _dense_attention(q, cache, tables, qsl, seq_lens, scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Float32 reference: each request's context gathered densely, causal with offset."""
    bs = cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, (table, seq_len) in enumerate(zip(tables, seq_lens, strict=True)):
        a, e = qsl[b], qsl[b + 1]
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(seq_len)])
        k = cache[0].flatten(0, 1)[slots].float()  # [L, Hkv, D]
        v = cache[1].flatten(0, 1)[slots].float()
        pos = torch.arange(seq_len - (e - a), seq_len)
        mask = torch.arange(seq_len)[None, :] <= pos[:, None]  # [q_len, L]
        o = F.scaled_dot_product_attention(
            q[a:e].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[a:e] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype,path", [(torch.float32, "avx512"), (torch.bfloat16, "avx512"), (torch.bfloat16, "amx")])
@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([37, 5, 16, 17], [1, 1, 1, 1]),  # decode, lengths differ (few rows: one kv head per work item; AVX-512 under 8 rows even on "amx")
        ([37, 5, 16, 17, 3, 64, 65, 1, 30, 31, 32, 48], [1] * 12),  # decode, rows enough for whole-row items
        ([40, 20], [15, 20]),  # prefill over a cached context (chunk / prefix hit), fresh prefill
        ([33, 12, 7], [1, 5, 7]),  # mixed
        ([100], [1]),  # one decode row: its context in segments over the threads, merged (AVX-512 path)
        ([300], [1]),
    ],
)
@pytest.mark.parametrize("d", [64, 128])
@torch.inference_mode()
def test_paged_attention_matches_dense_reference(dtype, seq_lens, q_lens, d, path) -> None:  # type: ignore[no-untyped-def]
    """Every path of the op (bfloat16 runs on AMX where the CPU has it, else on AVX-512) against
    a float32 dense reference; for SmolLM2's 9 / 3 heads too (the AMX path's resident B tiles)."""
    if not set_amx_attention(path == "amx") and path == "amx":
        set_amx_attention(True)
        pytest.skip("no AMX (amx_bf16) on this CPU, or SERVELAB_CPU_AMX=0: the op has no AMX path")
    poison = path == "avx512"  # its bfloat16 values pass reads tokens in pairs: never the slot after the last
    try:
        _check_paged_attention(dtype, seq_lens, q_lens, d, 6, 2, poison)
        if d == 64:
            _check_paged_attention(dtype, seq_lens, q_lens, d, 9, 3, poison)
    finally:
        set_amx_attention(True)


@pytest.mark.parametrize("threads", [1, 2, 4])
@torch.inference_mode()
def test_paged_attention_segments_of_one_rows_context(threads: int) -> None:
    """A decode step of one row has fewer work items than twice the threads: its context is
    attended in segments whose partial softmax sums are merged (2 at 2 threads, 3 at 4, none at
    1); every split against the dense reference, SmolLM2's 9 / 3 heads and 6 / 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in DTYPES:
            _check_paged_attention(dtype, [300], [1], 64, 9, 3)
            _check_paged_attention(dtype, [70], [1], 128, 6, 2)
    finally:
        torch.set_num_threads(before)


def _check_paged_attention(dtype, seq_lens, q_lens, d, hq, hkv, poison=False) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    bs, scale = 16, 0.125
    needed = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(needed) + 3).tolist()  # scattered blocks
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(2, len(perm), bs, hkv, d).to(dtype)
    if poison:  # the slots past each sequence's end hold NaN (never written): they must not reach the output
        for blocks, n in zip(tables, seq_lens, strict=True):
            cache[:, blocks[-1], n - (len(blocks) - 1) * bs :] = float("nan")
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    qkv = torch.randn(qsl[-1], hq + 2 * hkv, d).to(dtype)
    q = qkv[:, :hq]  # a strided view, as the model passes it
    width = max(needed)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    got = paged_attention_op()(q, cache, table, torch.tensor(qsl, dtype=torch.int32),
                               torch.tensor(seq_lens, dtype=torch.int32), scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), _dense_attention(q, cache, tables, qsl, seq_lens, scale), **TOL[dtype])


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_write_kv_matches_index_copy_and_rejects_bad_slots(dtype) -> None:  # type: ignore[no-untyped-def]
    from engine.kernels.paged_attention import write_kv_op

    torch.manual_seed(0)
    hq, hkv, d, nb, bs = 6, 2, 64, 5, 16
    qkv = torch.randn(7, hq + 2 * hkv, d).to(dtype)
    k, v = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # strided views, as the model passes them
    slots = torch.tensor([3, 17, 18, 40, 79, 0, 64])
    cache = torch.randn(2, nb, bs, hkv, d).to(dtype)
    want = cache.clone()
    flat = want.view(2, nb * bs, hkv, d)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)
    write_kv_op()(cache, k, v, slots)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        write_kv_op()(cache, k, v, slots.clone().fill_(nb * bs))


def test_ops_carry_schemas_and_fake_kernels_for_compile() -> None:
    """Each op passes torch.library.opcheck (schema, fake/meta implementation, dispatch)."""
    k = kernels()
    x, res, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    for dtype in DTYPES:
        xd, rd, wd = x.to(dtype), res.to(dtype), w.to(dtype)
        torch.library.opcheck(k.rms_norm, (xd, wd, 1e-5))
        torch.library.opcheck(k.add_rms_norm_, (xd.clone(), rd.clone(), wd, 1e-5))
        torch.library.opcheck(k.silu_mul, (torch.randn(3, 64).to(dtype),))
        qkv, cs = torch.randn(3, 5, 16).to(dtype), torch.randn(3, 16).to(dtype)
        torch.library.opcheck(k.rope_, (qkv, cs, cs, 4))
        cache = torch.randn(2, 4, 16, 1, 16).to(dtype)
        args = (torch.randn(2, 3, 16).to(dtype), cache, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1, 2]),
                torch.tensor([20, 9]), 0.25)
        torch.library.opcheck(torch.ops.servelab.paged_attention, args)
        kv = torch.randn(4, 1, 16).to(dtype)
        torch.library.opcheck(torch.ops.servelab.write_kv_, (cache.clone(), kv, kv, torch.tensor([5, 0, 63, 17])))


def test_layers_trace_without_graph_breaks() -> None:
    """torch.compile (dynamo, fullgraph) traces a layer calling the ops, for a compiled model runner."""
    torch.manual_seed(0)
    norm, mlp = layers.RMSNorm(32, 1e-5).to(torch.bfloat16), layers.GatedMLP(32, 48).to(torch.bfloat16)

    def f(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        y, r = norm.add_norm_(x, res)
        return mlp(y) + r

    x, res = torch.randn(4, 32).to(torch.bfloat16), torch.randn(4, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = f(x.clone(), res.clone())
        got = torch.compile(f, backend="eager", fullgraph=True)(x.clone(), res.clone())
    torch.testing.assert_close(got, want)


def test_a_build_is_named_after_its_sources_flags_and_cpu(tmp_path, monkeypatch):
    """torch caches builds by name: the name changes with the source, the headers it includes,
    the flags and the CPU (a -march=native build), and only with them, so no stale or foreign
    build loads; and the text compiled names no path, so two checkouts share a build."""
    import shutil

    from engine.kernels import cpu_extension, isa

    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_extension.CSRC, csrc)
    monkeypatch.setattr(cpu_extension, "CSRC", csrc)
    unit = cpu_extension.translation_unit("paged_attention.cpp")
    assert '#include "' not in unit and "#pragma once" not in unit and str(tmp_path) not in unit
    assert unit.count("static inline float ld(const float* p, int64_t i)") == 1  # kernel_header.h, once
    names = {s: cpu_extension.extension_name(s) for s in ("gemv.cpp", "paged_attention.cpp")}
    assert names["gemv.cpp"].startswith("servelab_gemv_") and names == {
        s: cpu_extension.extension_name(s) for s in names}
    assert cpu_extension.extension_name("gemv.cpp", ("-ffp-contract=off",)) != names["gemv.cpp"]
    # a header only paged attention includes: its build changes, the GEMV's does not
    (csrc / "paged_attention_common.h").write_text((csrc / "paged_attention_common.h").read_text() + "// edited\n")
    assert cpu_extension.extension_name("paged_attention.cpp") != names["paged_attention.cpp"]
    assert cpu_extension.extension_name("gemv.cpp") == names["gemv.cpp"]
    (csrc / "kernel_header.h").write_text((csrc / "kernel_header.h").read_text() + "// edited\n")
    edited = cpu_extension.extension_name("gemv.cpp")
    assert edited != names["gemv.cpp"]
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    other_cpu = cpu_extension.extension_name("gemv.cpp")
    assert other_cpu != edited
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert cpu_extension.extension_name("gemv.cpp") != other_cpu, "another torch must not load this build"


def test_a_finished_build_loads_in_another_venv_without_building(tmp_path):
    """A second venv (a fresh clone, the gate's baseline venv) loads the build as it is: torch's
    own loader rebuilt it for a minute because the ninja file names the venv's include paths.
    A build stamped by another torch, or one that does not load, is built again, never used."""
    import shutil
    import subprocess
    import sys

    from engine.kernels import cpu_extension, cpu_kernels

    if not cpu_kernels.kernels():
        pytest.skip("the C++ layer kernels do not build on this machine (no compiler?)")
    from torch.utils.cpp_extension import _get_build_directory

    name = cpu_extension.extension_name("layer_ops.cpp", ("-ffp-contract=off",))
    built = Path(_get_build_directory(name, verbose=False))
    assert (built / cpu_extension.READY_STAMP).read_text() == torch.__version__
    copy = tmp_path / "ext"
    shutil.copytree(built, copy / name, ignore=shutil.ignore_patterns("lock"))
    probe = (
        "import torch.utils.cpp_extension as ce\n"
        "def no_build(*a, **k): raise RuntimeError('a build was started')\n"
        "ce.load_inline = no_build\n"
        "from engine.kernels import cpu_kernels\n"
        "print('loaded' if cpu_kernels.kernels() else 'fallback')\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(copy)}

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip() + done.stderr

    assert run() == "loaded"
    (copy / name / cpu_extension.READY_STAMP).write_text("2.0.0")  # built by another torch
    out = run()
    assert out.startswith("fallback") and "a build was started" in out
    (copy / name / cpu_extension.READY_STAMP).write_text(torch.__version__)
    (copy / name / f"{name}.so").write_bytes(b"not a library")
    out = run()
    assert out.startswith("fallback") and "did not load" in out and "a build was started" in out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 49152])
def test_argmax_rows_matches_torch_max_indices(dtype, vocab) -> None:  # type: ignore[no-untyped-def]
    """Greedy sampling's argmax: the first maximum of each row, a NaN counting as the maximum
    (the first NaN), exactly as `max(dim=-1).indices`, read in the logits' own dtype."""
    torch.manual_seed(0)
    x = torch.randn(12, vocab).to(dtype)
    x[1] = 1.0  # all tied: index 0
    x[2, vocab - 1] = 100.0  # the maximum in the scalar tail
    x[3] = float("-inf")
    x[4, vocab // 2] = float("nan")
    x[5, (2 * vocab) // 3] = float("nan")
    x[5, vocab // 3] = float("nan")  # two NaNs: the first wins
    x[6, : vocab // 2] = 7.0  # a tie spread over several vector lanes
    x[7, vocab - 1] = float("inf")
    got = kernels().argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 300, 49152])
def test_near_max_rows_matches_torch_compare_and_nonzero(dtype, vocab) -> None:  # type: ignore[no-untyped-def]
    """The candidates of greedy's float32 rescoring: each row's first maximum, the count of its
    values >= floor (the maximum less |max| * rel, rounded to the logits' dtype; 0 for a NaN
    maximum) and the first k of their indices, as torch's max / compare / nonzero give them."""
    torch.manual_seed(0)
    rel, k = 2.0**-6, 4
    x = (torch.randn(10, vocab) * 8).to(dtype)
    x[1] = 1.0  # all tied: every index a candidate
    x[2, vocab - 1] = 100.0  # the maximum in the scalar tail
    x[3] = float("-inf")
    x[4, vocab // 2] = float("nan")
    x[5, : min(vocab, 3)] = 50.0  # three tied near the start
    x[6, vocab // 3] = 60.0
    x[6, (2 * vocab) // 3] = 59.9  # within rel of the maximum: two candidates
    x[7] = -x[7].abs() - 5  # a negative maximum: the floor lies below it
    x[8, vocab // 4] = float("inf")  # an infinite maximum: its floor is NaN, no candidate
    x[9] = 64.0
    x[9, 0] = 65.0  # floor 65 - 65/64 = 63.98 rounds up to 64 in bfloat16: every 64 is a candidate
    first, count, cols = kernels().near_max_rows(x, rel, k)
    top, want_first = x.max(dim=-1)
    assert torch.equal(first, want_first)
    floor = (top.float() - top.float().abs() * rel).to(dtype)
    for r in range(x.shape[0]):
        idx = (x[r] >= floor[r]).nonzero().flatten()
        assert int(count[r]) == idx.numel(), r
        want = torch.full((k,), -1, dtype=torch.int64)
        want[: min(k, idx.numel())] = idx[:k]
        assert torch.equal(cols[r], want), r


@pytest.mark.parametrize(
    "hq,hkv,d,seq_lens,q_lens",
    [
        (9, 3, 64, [40, 20, 150], [15, 20, 150]),  # prefill over a cached context, fresh prefills
        (6, 2, 128, [33, 17, 64, 5], [33, 1, 7, 5]),  # a one-row request, partial query blocks
        (9, 3, 64, [300, 1], [45, 1]),  # a long context, a single-token prompt
    ],
)
@torch.inference_mode()
def test_amx_prefill_attention_matches_dense_reference(hq, hkv, d, seq_lens, q_lens) -> None:  # type: ignore[no-untyped-def]
    """The AMX prefill op (bfloat16) against a float32 dense reference, requests given in any
    order; the rows of a request it is not given (here request 0) are left untouched."""
    from engine.kernels.paged_attention import paged_prefill_attention_op

    torch.manual_seed(0)
    bs, scale = 16, d**-0.5
    needed = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(needed) + 3).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(2, len(perm), bs, hkv, d).bfloat16()
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], hq + 2 * hkv, d).bfloat16()[:, :hq]
    width = max(needed)
    order = list(range(1, len(seq_lens)))[::-1]
    table = torch.tensor([tables[b] + [0] * (width - len(tables[b])) for b in order], dtype=torch.int32)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    ran = paged_prefill_attention_op()(
        out, q, cache, table, torch.tensor([qsl[b] for b in order]), torch.tensor([q_lens[b] for b in order]),
        torch.tensor([seq_lens[b] for b in order]), scale,
    )
    if not ran:
        pytest.skip("no AMX (amx_bf16) on this CPU, or SERVELAB_CPU_AMX=0: the prefill op has no AMX path")
    want = _dense_attention(q, cache, tables, qsl, seq_lens, scale)
    torch.testing.assert_close(out[qsl[1] :].float(), want[qsl[1] :], **TOL[torch.bfloat16])
    assert torch.all(out[: qsl[1]] == 7.0)
