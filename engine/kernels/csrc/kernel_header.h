// Storage-type helpers shared by the CPU kernel sources (vectorisable: plain integer shifts, no calls):
// kernels are templates over float / bfloat16 storage and compute in float32.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace servelab {
using bf16 = c10::BFloat16;

static inline float ld(const float* p, int64_t i) { return p[i]; }
static inline float ld(const bf16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline void st(float* p, int64_t i, float v) { p[i] = v; }
// Round to nearest even (as torch's float -> bfloat16 cast does for finite values).
static inline void st(bf16* p, int64_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(u >> 16);
}

// exp(x) as 2^n * 2^f (n = round(x log2 e), |f| <= 1/2, 2^f by its degree-7 Taylor polynomial:
// relative error < 1e-7): plain arithmetic and bit moves, so the loop below vectorises (std::exp
// does not: it made SiLU*mul 4x slower than torch's silu).
static inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.f), 88.f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.5252733804059840e-5f;
  p = p * f + 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX512F__)
// Sixteen lanes at a time (AVX-512, where -march=native has it): load as float32, store rounded
// to the storage type, exp as exp_approx (whose scalar form does not vectorise: fminf).
static inline __m512 vld(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 vld(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void vst(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void vst(bf16* p, __m512 v) {  // round to nearest even, as st() does
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));  // one instruction
  return;
#endif
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
static inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_approx eight lanes at a time (AVX2 + FMA: 2^n 2^f, the same degree-7 polynomial for 2^f).
static inline __m256 vexp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5252733804059840e-5f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-4f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static inline void check_cpu(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, what,
              ": float32 or bfloat16, got ", t.scalar_type());
}
}  // namespace servelab

// Run body<T> with T = float or c10::BFloat16 after the dtype of `t`.
#define SERVELAB_DISPATCH(t, ...)                                          \
  if ((t).scalar_type() == torch::kBFloat16) {                             \
    using scalar_t = c10::BFloat16;                                        \
    __VA_ARGS__();                                                         \
  } else {                                                                 \
    using scalar_t = float;                                                \
    __VA_ARGS__();                                                         \
  }
