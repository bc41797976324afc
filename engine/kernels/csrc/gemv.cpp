#include "kernel_header.h"
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
