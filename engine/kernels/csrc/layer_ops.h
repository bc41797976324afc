// The per-row layer ops' loops (layer_ops.cpp's torch ops and planned_layers.cpp's team step):
// residual add + RMS norm, RMS norm, rotary embedding, SiLU-mul. Each runs its rows through at::parallel_for
// (inline for a step of a few rows, and inside a parallel region).
#pragma once
#include <type_traits>
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

// One row's rotary embedding, out of line and with FMA contraction off: each library compiles its own copy
// (layer_ops.cpp's op, the one-call layer loops' team steps), and where one fused a * c + b * s into an FMA
// and another did not, the two differed in the last bit (the team steps must equal the op bit for bit).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) static void rope_row(T* row, const T* c, const T* s,
                                                                           int64_t D, int64_t heads) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * D;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = ld(x, i), bb = ld(x, i + half);
      st(x, i, a * ld(c, i) + bb * ld(s, i));
      st(x, i + half, bb * ld(c, i + half) + a * ld(s, i + half));
    }
  }
}

template <typename T>
static void rope_impl(T* qp, const T* cp, const T* sp, int64_t T_, int64_t HT, int64_t D, int64_t heads) {
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) rope_row(qp + t * HT * D, cp + t * D, sp + t * D, D, heads);
  });
}

// out[t] = silu(gate_up[t, :I]) * gate_up[t, I:] for each of T_ rows.
template <typename T>
static void silu_mul_impl(const T* gp, T* op, int64_t T_, int64_t I) {
  at::parallel_for(0, T_, 8, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      int64_t i0 = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i0 + 16 <= I; i0 += 16) {
        const __m512 gv = vld(g + i0);
        // 1 / (1 + exp(-g)): rcp14 and one Newton step (relative error ~2^-28, a division's
        // accuracy in float32 at a fraction of its cost; the division bounded this loop).
        const __m512 den = _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
        __m512 sig = _mm512_rcp14_ps(den);
        sig = _mm512_mul_ps(sig, _mm512_fnmadd_ps(den, sig, _mm512_set1_ps(2.f)));
        vst(o + i0, _mm512_mul_ps(_mm512_mul_ps(gv, sig), vld(u + i0)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {  // eight lanes: the scalar exp_approx does not vectorise
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i0 + 8 <= I; i0 += 8) {
          const __m256 gv = _mm256_loadu_ps(g + i0);
          const __m256 den = _mm256_add_ps(one, vexp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
          _mm256_storeu_ps(o + i0, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i0)));
        }
      }
#endif
      for (int64_t i = i0; i < I; ++i) {
        const float gv = ld(g, i);
        st(o, i, gv / (1.f + exp_approx(-gv)) * ld(u, i));
      }
    }
  });
}

}  // namespace servelab
