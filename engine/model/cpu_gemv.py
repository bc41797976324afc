"""x @ W.T for a few rows (decode at low batch), streaming W once at memory speed (C++).

At 1-4 rows a linear is a matrix-vector product: its time is the time to read W. The CPU BLAS
and oneDNN both run it far below the memory's speed on some CPUs: on a 2-core AMD EPYC (AVX2)
MKL's float32 GEMV read SmolLM2's weights at ~6 GB/s on one thread and oneDNN's at ~19 GB/s
(benchmarks/cpu_decode_step.py --batch 1). This op splits W's rows over the threads and reads
each row once, contiguous, with every input row's dot product accumulated in registers
(AVX2 + FMA where the build has them, else plain loops the compiler vectorises):

    gemv_f32(Tensor x, Tensor w) -> Tensor
        x [M, K] float32 (M <= MAX_ROWS), w [N, K] float32 row-major, both contiguous -> [M, N]
    gemv_bf16(Tensor x, Tensor w) -> Tensor
        the same in bfloat16: products and sums in float32 (vdpbf16ps where the CPU has
        AVX512-BF16), each output rounded once to bfloat16, as oneDNN's bfloat16 linear does.
        oneDNN's own kernel read SmolLM2's bfloat16 weights at ~18 GB/s at one row on a 2-core
        AMD EPYC Zen 5, whose memory streams ~30 GB/s (benchmarks/cpu_decode_step.py --batch 1).

The sums run in another order than the BLAS's / oneDNN's, so results differ from `F.linear` by
float32 rounding only (and in bfloat16 by the output's rounding, rarely: tests/test_cpu_gemv.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cpu_extension import load_cpu_ops
from engine.platform import cpu_flags

MAX_ROWS = 4
# bfloat16 rows where the op beats oneDNN's packed linear: SmolLM2's projections and LM head, 2-core
# AMD EPYC Zen 5 (AVX512-BF16), 30 layers' weights out of cache: 1 row 8.8 vs 14.0 ms (30.7 vs
# 19.2 GB/s), 2 rows 10.2 vs 12.1 ms, 4 rows 16.8 vs 15.0 ms (there the multiply-adds, not the reads,
# bound it).
MAX_ROWS_BF16 = 2

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

template <typename T>
static void gemv_plain(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N, int64_t b, int64_t e) {
  for (int64_t n = b; n < e; ++n)
    for (int64_t i = 0; i < M; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += ld(x, i * K + k) * ld(w, n * K + k);
      st(y, i * N + n, s);
    }
}

#if defined(__AVX512F__)
// bfloat16: R weight rows n .. n + R against M input rows, M * R accumulators of 16 float32
// lanes, 32 elements a step (K % 32 == 0): vdpbf16ps on the stored values where the CPU has
// AVX512-BF16, else both operands widened to float32 (a shift) and multiply-added.
template <int M, int R>
static inline void rows_block_bf16(const bf16* x, const bf16* w, bf16* y, int64_t K, int64_t N, int64_t n) {
  __m512 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const bf16* wr = w + n * K;
  for (int64_t k = 0; k < K; k += 32) {
#if defined(__AVX512BF16__)
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(wr + r * K + k);
    for (int i = 0; i < M; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, (__m512bh)wv[r]);
    }
#else
    for (int h = 0; h < 32; h += 16) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = vld(wr + r * K + k + h);
      for (int i = 0; i < M; ++i) {
        const __m512 xv = vld(x + i * K + k + h);
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
      }
    }
#endif
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) st(y, i * N + n + r, _mm512_reduce_add_ps(acc[i][r]));
}

template <int M>
static void gemv_rows_bf16(const bf16* x, const bf16* w, bf16* y, int64_t K, int64_t N, int64_t b, int64_t e) {
  constexpr int R = M <= 2 ? 4 : 2;
  int64_t n = b;
  for (; n + R <= e; n += R) rows_block_bf16<M, R>(x, w, y, K, N, n);
  for (; n < e; ++n) rows_block_bf16<M, 1>(x, w, y, K, N, n);
}
#endif

// Checks both operands (contiguous [M, K] and [N, K] of dtype `dt`, 1 <= M <= 4), then runs
// y = x @ w.T over chunks of >= 64 weight rows (enough to stream, few enough to keep every thread
// busy): `fast(b, e)` where it takes the chunk (returns true), else the plain loop.
template <typename T, typename Fast>
static torch::Tensor gemv_run(const torch::Tensor& x, const torch::Tensor& w, torch::ScalarType dt, const char* what,
                              Fast fast) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x.scalar_type() == dt && w.scalar_type() == dt, "x, w: ", what);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous(),
              "x [M, K], w [N, K]: contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4, "x: 1 to 4 rows");
  auto y = torch::empty({M, N}, x.options());
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    if (!fast(xp, wp, yp, M, K, N, b, e)) gemv_plain(xp, wp, yp, M, K, N, b, e);
  });
  return y;
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w) {
  return gemv_run<bf16>(x, w, torch::kBFloat16, "bfloat16",
                        [](const bf16* xp, const bf16* wp, bf16* yp, int64_t M, int64_t K, int64_t N, int64_t b,
                           int64_t e) {
#if defined(__AVX512F__)
    if (K % 32 == 0) {
      switch (M) {
        case 1: gemv_rows_bf16<1>(xp, wp, yp, K, N, b, e); return true;
        case 2: gemv_rows_bf16<2>(xp, wp, yp, K, N, b, e); return true;
        case 3: gemv_rows_bf16<3>(xp, wp, yp, K, N, b, e); return true;
        default: gemv_rows_bf16<4>(xp, wp, yp, K, N, b, e); return true;
      }
    }
#endif
    (void)xp, (void)wp, (void)yp, (void)M, (void)K, (void)N, (void)b, (void)e;
    return false;
  });
}

torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w) {
  return gemv_run<float>(x, w, torch::kFloat32, "float32",
                         [](const float* xp, const float* wp, float* yp, int64_t M, int64_t K, int64_t N, int64_t b,
                            int64_t e) {
#if defined(__AVX2__) && defined(__FMA__)
    if (K % 8 == 0) {
      switch (M) {
        case 1: gemv_rows<1>(xp, wp, yp, K, N, b, e); return true;
        case 2: gemv_rows<2>(xp, wp, yp, K, N, b, e); return true;
        case 3: gemv_rows<3>(xp, wp, yp, K, N, b, e); return true;
        default: gemv_rows<4>(xp, wp, yp, K, N, b, e); return true;
      }
    }
#endif
    (void)xp, (void)wp, (void)yp, (void)M, (void)K, (void)N, (void)b, (void)e;
    return false;
  });
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("gemv_f32", &servelab::gemv_f32);
  m.impl("gemv_bf16", &servelab::gemv_bf16);
}
"""

# Bump with every change of _CPP_SOURCE (torch caches builds by name).
_EXTENSION_NAME = "servelab_cpu_gemv_v3"


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::gemv_f32")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("servelab::gemv_bf16")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))


def gemv_ops() -> Any | None:
    """`torch.ops.servelab` with `gemv_f32` and `gemv_bf16` loaded, or None where they cannot be built."""
    if load_cpu_ops(_EXTENSION_NAME, _CPP_SOURCE, "GEMV", _register_fakes):
        return torch.ops.servelab
    return None


def max_rows(dtype: torch.dtype) -> int:
    """The most rows the GEMV takes in `dtype` (0: none)."""
    return MAX_ROWS if dtype == torch.float32 else MAX_ROWS_BF16 if dtype == torch.bfloat16 else 0


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The op takes these operands (few rows of float32, or of bfloat16, and a row-major weight
    of the same dtype, on a CPU) and runs them fast: bfloat16 only on its vector path (AVX-512,
    K a multiple of 32; its scalar loop is ~6x slower than oneDNN)."""
    return (
        x.dim() == 2 and 1 <= x.shape[0] <= max_rows(x.dtype) and w.dtype == x.dtype and x.device.type == "cpu"
        and w.is_contiguous() and not torch.compiler.is_compiling()
        and (x.dtype != torch.bfloat16 or (x.shape[1] % 32 == 0 and "avx512f" in cpu_flags()))
    )  # fmt: skip


def gemv(ops: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T by the op of x's dtype (operands that `applies` accepted)."""
    return ops.gemv_f32(x, w) if x.dtype == torch.float32 else ops.gemv_bf16(x, w)
