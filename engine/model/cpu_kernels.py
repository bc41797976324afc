"""Fused float32 CPU kernels for the Llama layer's element-wise work (C++, compiled on first use).

On a CPU every element-wise torch op is one more pass over memory (and `F.rms_norm`
is itself ~5 ops there). These fuse each step of the layer into one or two passes:
- `add_rms_norm_(x, residual, weight, eps)`: residual += x; x = rms_norm(residual) * weight (in place);
- `rms_norm(x, weight, eps)` -> new tensor;
- `rope_(qkv, cos, sin, heads)`: rotate-half RoPE in place on the first `heads` heads of qkv [T, H, D]
  with cos / signed-sin rows [T, D] (the tables of `RotaryEmbedding`);
- `silu_mul(gate_up)` [T, 2I] -> silu(gate) * up [T, I].
`kernels()` returns None where no C++ toolchain builds them; callers then use torch ops.
"""

from __future__ import annotations

from types import ModuleType

from engine.cpu_extension import load_cpu_extension

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

static void check(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), what, ": contiguous cpu float32");
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check(x, "x"); check(residual, "residual"); check(weight, "weight");
  const int64_t H = x.size(-1), T = x.numel() / H;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      float* xr = xp + t * H;
      float* rr = rp + t * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) { const float v = xr[i] + rr[i]; rr[i] = v; ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) xr[i] = wp[i] * (rr[i] * inv);
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, "x"); check(weight, "weight");
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), T = x.numel() / H;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* xr = xp + t * H;
      float* orow = op + t * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  check(qkv, "qkv"); check(cos, "cos"); check(sin, "sin");
  const int64_t T = qkv.size(0), HT = qkv.size(1), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && heads <= HT, "rope shapes");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = qp + (t * HT + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], bb = x[i + half];
          x[i] = a * c[i] + bb * s[i];
          x[i + half] = bb * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, "gate_up");
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, T = gate_up.numel() / I2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = gp + t * I2;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rms_norm", &rms_norm);
  m.def("rope_", &rope_);
  m.def("silu_mul", &silu_mul);
}
"""

def kernels() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (callers fall back to torch ops)."""
    return load_cpu_extension("servelab_cpu_layer_kernels_v1", _CPP_SOURCE, "llama layers", ("-ffp-contract=off",))
