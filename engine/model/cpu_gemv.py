"""float32 x @ W.T for a few rows (decode at low batch), streaming W once at memory speed (C++).

At 1-4 rows a linear is a matrix-vector product: its time is the time to read W. The CPU BLAS
and oneDNN both run it far below the memory's speed on some CPUs: on a 2-core AMD EPYC (AVX2)
MKL's float32 GEMV read SmolLM2's weights at ~6 GB/s on one thread and oneDNN's at ~19 GB/s
(benchmarks/cpu_decode_step.py --batch 1). This op splits W's rows over the threads and reads
each row once, contiguous, with every input row's dot product accumulated in registers
(AVX2 + FMA where the build has them, else plain loops the compiler vectorises):

    gemv_f32(Tensor x, Tensor w) -> Tensor
        x [M, K] float32 (M <= MAX_ROWS), w [N, K] float32 row-major, both contiguous -> [M, N]

The sums run in another order than the BLAS's, so results differ from `F.linear` by float32
rounding only (tests/test_cpu_gemv.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cpu_extension import load_cpu_ops

MAX_ROWS = 4

_CPP_SOURCE = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace servelab {

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// R weight rows n .. n + R against M input rows: M * R accumulators of 8 lanes (K % 8 == 0).
template <int M, int R>
static inline void rows_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n) {
  __m256 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const float* wr = w + n * K;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(wr + r * K + k);
    for (int i = 0; i < M; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) y[i * N + n + r] = hsum8(acc[i][r]);
}

template <int M>
static void gemv_rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t b, int64_t e) {
  constexpr int R = M <= 2 ? 4 : 2;
  int64_t n = b;
  for (; n + R <= e; n += R) rows_block<M, R>(x, w, y, K, N, n);
  for (; n < e; ++n) rows_block<M, 1>(x, w, y, K, N, n);
}
#endif

static void gemv_plain(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t b,
                       int64_t e) {
  for (int64_t n = b; n < e; ++n)
    for (int64_t i = 0; i < M; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * w[n * K + k];
      y[i * N + n] = s;
    }
}

torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "x, w: float32");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous(),
              "x [M, K], w [N, K]: contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4, "x: 1 to 4 rows");
  auto y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Chunks of >= 64 weight rows: enough to stream, few enough to keep both threads busy.
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
#if defined(__AVX2__) && defined(__FMA__)
    if (K % 8 == 0) {
      switch (M) {
        case 1: gemv_rows<1>(xp, wp, yp, K, N, b, e); return;
        case 2: gemv_rows<2>(xp, wp, yp, K, N, b, e); return;
        case 3: gemv_rows<3>(xp, wp, yp, K, N, b, e); return;
        default: gemv_rows<4>(xp, wp, yp, K, N, b, e); return;
      }
    }
#endif
    gemv_plain(xp, wp, yp, M, K, N, b, e);
  });
  return y;
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("gemv_f32", &servelab::gemv_f32);
}
"""

# Bump with every change of _CPP_SOURCE (torch caches builds by name).
_EXTENSION_NAME = "servelab_cpu_gemv_v1"


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::gemv_f32")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))


def gemv_ops() -> Any | None:
    """`torch.ops.servelab` with `gemv_f32` loaded, or None where it cannot be built."""
    if load_cpu_ops(_EXTENSION_NAME, _CPP_SOURCE, "float32 GEMV", _register_fakes):
        return torch.ops.servelab
    return None


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The op takes these operands (few float32 rows, a row-major float32 weight, on a CPU)."""
    return (
        x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and w.dtype == torch.float32
        and x.device.type == "cpu" and w.is_contiguous() and not torch.compiler.is_compiling()
    )  # fmt: skip
