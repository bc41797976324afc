"""The fused C++ CPU kernels of the Llama layer equal the torch-ops fallback they replace."""

from __future__ import annotations

import pytest
import torch

from engine.model import layers
from engine.model.cpu_kernels import kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C++ toolchain: the fused kernels are not built")


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Within the test body, call the layers with the fallback via `torch_ops()`."""

    def run(fn):  # type: ignore[no-untyped-def]
        with monkeypatch.context() as m:
            m.setattr(layers, "kernels", lambda: None)
            return fn()

    return run


@torch.inference_mode()
def test_rms_norm_and_fused_residual_add(torch_ops) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    norm = layers.RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    x, res = torch.randn(7, 96), torch.randn(7, 96)
    torch.testing.assert_close(norm(x), torch_ops(lambda: norm(x)), rtol=1e-5, atol=1e-5)
    want_out, want_res = torch_ops(lambda: norm(x, res))
    got_out, got_res = norm.add_norm_(x.clone(), res.clone())
    torch.testing.assert_close(got_res, want_res)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_rope_in_place_on_the_first_heads(torch_ops) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    rope = layers.RotaryEmbedding(64, 256, 10000.0)
    qkv = torch.randn(5, 9 + 3 + 3, 64)  # q heads, k heads, v heads of a fused projection
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 17, 100, 255]))
    want = torch_ops(lambda: layers.RotaryEmbedding.rotate_heads_(qkv.clone(), 12, cos, sin))
    got = layers.RotaryEmbedding.rotate_heads_(qkv.clone(), 12, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 12:], qkv[:, 12:])  # v heads untouched


@torch.inference_mode()
def test_silu_mul(torch_ops) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mlp = layers.GatedMLP(32, 80)
    x = torch.randn(6, 32)
    torch.testing.assert_close(mlp(x), torch_ops(lambda: mlp(x)), rtol=1e-5, atol=1e-5)
