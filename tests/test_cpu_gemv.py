"""The GEMV for a few rows (engine/kernels/cpu_gemv.py), float32 and bfloat16, against a float64
reference, and its use by the planned forward (a model whose linears are prepacked)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_gemv
from engine.kernels.isa import cpu_flags

ops = cpu_gemv.gemv_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ toolchain to build the GEMV op")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(960, 576), (67, 576), (5, 40), (3, 7)])  # odd N; K % 8 != 0: plain loop
def test_gemv_matches_float64_reference(rows: int, shape: tuple[int, int]) -> None:
    torch.manual_seed(rows)
    w = torch.randn(shape)
    x = torch.randn(rows, shape[1])
    got = ops.gemv_f32(x, w)  # type: ignore[union-attr]
    want = F.linear(x.double(), w.double())
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(960, 576), (67, 1536), (5, 40), (3, 7)])  # K % 32 != 0: plain loop
def test_bf16_gemv_is_the_float32_sum_of_exact_products_rounded_once(rows: int, shape: tuple[int, int]) -> None:
    """bfloat16 operands: every product is exact in float32 and the sum is float32 (vdpbf16ps or
    widened multiply-adds), so the output is the float64 result rounded to bfloat16, give or take
    one bfloat16 step where float32 summation order moves a value across a rounding boundary."""
    torch.manual_seed(rows)
    w = torch.randn(shape).bfloat16()
    x = torch.randn(rows, shape[1]).bfloat16()
    got = ops.gemv_bf16(x, w)  # type: ignore[union-attr]
    want = F.linear(x.double(), w.double())
    assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
    step = want.abs().clamp_min(1e-30) * 2.0**-7  # one bfloat16 step (8 significant bits) at each value
    assert bool(((got.double() - want).abs() <= step + 1e-3 * shape[1] ** 0.5).all())
    exact = got.double() == want.bfloat16().double()
    assert exact.float().mean() > 0.95  # nearly all rounded exactly as the float64 result


def test_bf16_gemv_applies_to_one_or_two_rows_only() -> None:
    """bfloat16 rows take the GEMV only on its AVX-512 path (its scalar loop is slower than oneDNN):
    on an AVX2-only CPU none do."""
    w = torch.randn(8, 64).bfloat16()
    assert cpu_gemv.applies(torch.randn(2, 64).bfloat16(), w) == ("avx512f" in cpu_flags())
    assert not cpu_gemv.applies(torch.randn(3, 64).bfloat16(), w)  # oneDNN is faster from 3-4 rows
    assert not cpu_gemv.applies(torch.randn(1, 64), w)  # dtypes differ
    assert not cpu_gemv.applies(torch.randn(1, 48).bfloat16(), torch.randn(8, 48).bfloat16())  # K % 32: scalar loop
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.gemv_bf16(torch.randn(1, 64), w.float())  # type: ignore[union-attr]


def test_gemv_refuses_what_it_does_not_take() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.gemv_f32(torch.randn(5, 16), w)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="float32"):
        ops.gemv_f32(torch.randn(1, 16).bfloat16(), w.bfloat16())  # type: ignore[union-attr]
    assert not cpu_gemv.applies(torch.randn(1, 16), w.t().contiguous().t())  # column-major: not taken
    assert cpu_gemv.applies(torch.randn(4, 16), w) and not cpu_gemv.applies(torch.randn(5, 16), w)


def test_float32_engine_with_prepacked_linears_gives_the_plain_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 with oneDNN prepacking forced on (the AVX2-only CPU's choice) and the GEMV on
    decode steps of <= 4 rows: the greedy tokens of the plain float32 engine."""
    from engine.frontend.llm import LLM
    from engine.kernels import cpu_linear
    from engine.sampling_params import SamplingParams

    if not cpu_linear.prepack_supported(torch.empty(1, 1, dtype=torch.bfloat16)) and not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        pytest.skip("this torch has no oneDNN (mkldnn)")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 10, list(range(100, 140))]
    outs = []
    monkeypatch.delenv("SERVELAB_ONEDNN_FP32", raising=False)
    for forced in ("prepacked", "plain"):
        llm = LLM(model="smollm2", load_format="dummy", num_layers_override=2, dtype="float32",
                  num_blocks=64, max_num_seqs=4, float32_linear=forced)  # fmt: skip
        plan = llm.engine_core.executor.worker.model.model.plan  # type: ignore[attr-defined]
        assert (plan is not None and plan.gemv_ops is not None) == (forced == "prepacked")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    # the environment overrides the field (KERNEL_ENV_OVERRIDES), and the config then says so
    monkeypatch.setenv("SERVELAB_ONEDNN_FP32", "0")
    assert LLM.__name__ and _kernels(float32_linear="prepacked").float32_linear == "plain"


def _kernels(**fields: object) -> object:
    from engine.config import EngineConfig

    return EngineConfig.from_sections({"kernels": fields}).kernels
