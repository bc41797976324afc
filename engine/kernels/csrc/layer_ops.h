// The per-row layer ops' loops (layer_ops.cpp's torch ops and planned_layers.cpp's team step):
// residual add + RMS norm, RMS norm, rotary embedding. Each runs its rows through at::parallel_for
// (inline for a step of a few rows, and inside a parallel region).
#pragma once
#include "kernel_header.h"

namespace servelab {

#if defined(__AVX512F__)
// Sum of squares of row r[0 .. H) (sixteen lanes, then one reduction) and the scalar tail's start.
template <typename T>
static inline float sum_squares(const T* r, int64_t H, int64_t& tail) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 v = vld(r + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  tail = i;
  return _mm512_reduce_add_ps(acc);
}
#endif

// Row t: residual += x (rounded to the storage type), then x = weight * (residual / rms(residual)).
template <typename T>
static inline void add_rms_norm_row(T* xr, T* rr, const T* wp, int64_t H, float e) {
  int64_t i0 = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  for (; i0 + 16 <= H; i0 += 16) vst(rr + i0, _mm512_add_ps(vld(xr + i0), vld(rr + i0)));
  for (int64_t i = i0; i < H; ++i) st(rr, i, ld(xr, i) + ld(rr, i));
  int64_t tail = 0;
  ss = sum_squares(rr, H, tail);  // the residual as stored (rounded in bfloat16)
  for (int64_t i = tail; i < H; ++i) ss += ld(rr, i) * ld(rr, i);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) vst(xr + i, _mm512_mul_ps(vld(wp + i), _mm512_mul_ps(vld(rr + i), vinv)));
  for (; i < H; ++i) st(xr, i, ld(wp, i) * (ld(rr, i) * inv));
#else
  for (int64_t i = 0; i < H; ++i) {
    st(rr, i, ld(xr, i) + ld(rr, i));
    const float vr = ld(rr, i);
    ss += vr * vr;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
  for (int64_t i = 0; i < H; ++i) st(xr, i, ld(wp, i) * (ld(rr, i) * inv));
  (void)i0;
#endif
}

template <typename T>
static void add_rms_norm_impl(T* xp, T* rp, const T* wp, int64_t T_, int64_t H, float e) {
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) add_rms_norm_row(xp + t * H, rp + t * H, wp, H, e);
  });
}

template <typename T>
static void rms_norm_impl(const T* xp, T* op, const T* wp, int64_t T_, int64_t H, float e) {
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const T* xr = xp + t * H;
      T* orow = op + t * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) { const float v = ld(xr, i); ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) st(orow, i, ld(wp, i) * (ld(xr, i) * inv));
    }
  });
}

template <typename T>
static void rope_impl(T* qp, const T* cp, const T* sp, int64_t T_, int64_t HT, int64_t D, int64_t heads) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qp + (t * HT + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = ld(x, i), bb = ld(x, i + half);
          st(x, i, a * ld(c, i) + bb * ld(s, i));
          st(x, i + half, bb * ld(c, i + half) + a * ld(s, i + half));
        }
      }
    }
  });
}

}  // namespace servelab
