// What every block linear of block_linear.cpp shares: the block kinds and their sizes, fp16 scales
// to float, and x quantised per 32-input block in about 14 bits (block_linear.cpp's note says how and
// why). kquant_blocks.h (Q4_K, Q6_K) and block_linear.cpp (Q4_1, Q8_0, Q5_0) multiply with them.
#pragma once
#include "kernel_header.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SERVELAB_BLOCKS_AVX2 1
#endif

namespace servelab {
namespace blocks {

enum class Kind : int { Q4_1 = 0, Q8_0 = 1, Q5_0 = 2, Q4_K = 3, Q6_K = 4 };

static inline Kind kind_of(const std::string& name) {
  if (name == "Q4_1") return Kind::Q4_1;
  if (name == "Q8_0") return Kind::Q8_0;
  if (name == "Q5_0") return Kind::Q5_0;
  if (name == "Q4_K") return Kind::Q4_K;
  if (name == "Q6_K") return Kind::Q6_K;
  TORCH_CHECK(false, "block_linear: block kind Q4_1, Q8_0, Q5_0, Q4_K or Q6_K, got ", name);
}
static constexpr bool is_kquant(Kind k) { return k == Kind::Q4_K || k == Kind::Q6_K; }
// Weights per GGUF block (32, or a K-quant's 256-weight super-block) and its bytes as stored.
static constexpr int64_t block_weights(Kind k) { return is_kquant(k) ? 256 : 32; }
static constexpr int64_t block_bytes(Kind k) {
  return k == Kind::Q4_1 ? 20 : k == Kind::Q8_0 ? 34 : k == Kind::Q5_0 ? 22 : k == Kind::Q4_K ? 144 : 210;
}
// The 32-weight kinds: quant bytes per block in the packed column, fp16 scales per block.
static constexpr int64_t quant_bytes(Kind k) { return k == Kind::Q4_1 ? 16 : k == Kind::Q8_0 ? 32 : 20; }
static constexpr int64_t scale_count(Kind k) { return k == Kind::Q4_1 ? 2 : 1; }
// The K-quants: a packed super-block's bytes (kquant_blocks.h: Q4_K's scales unpacked to bytes).
static constexpr int64_t super_bytes(Kind k) { return k == Kind::Q4_K ? 148 : 210; }
static inline int64_t padded8(int64_t kb) { return (kb + 7) / 8 * 8; }
// A packed column's bytes for KB 32-input blocks (block_linear.cpp's and kquant_blocks.h's notes).
static inline int64_t column_bytes(Kind k, int64_t KB) {
  return is_kquant(k) ? KB / 8 * super_bytes(k) : KB * quant_bytes(k) + padded8(KB) * 2 * scale_count(k);
}

// IEEE half -> float, with no instruction-set flag (the F16C path converts in one instruction).
static inline float half_to_float(const uint8_t* p) {
  const uint16_t h = static_cast<uint16_t>(p[0] | (p[1] << 8));
#if defined(SERVELAB_BLOCKS_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// x's rows quantised per 32-input block (module note): hi / lo bytes [M, K], s and sx [M, KB8]
// (zero past KB, so padded scales contribute nothing).
struct QuantX {
  std::vector<int8_t> hi, lo;
  std::vector<float> s, sx;
  int64_t KB = 0, KB8 = 0;
};

template <typename T>
static inline void quantize_x(const T* x, int64_t M, int64_t K, QuantX& qx) {
  const int64_t KB = K / 32, KB8 = padded8(KB);
  qx.KB = KB;
  qx.KB8 = KB8;
  qx.hi.resize(M * K);
  qx.lo.resize(M * K);
  qx.s.assign(M * KB8, 0.f);
  qx.sx.assign(M * KB8, 0.f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < KB; ++b) {
      float v[32], amax = 0.f, sum = 0.f;
      bool finite = true;
      for (int k = 0; k < 32; ++k) {
        v[k] = ld(x, r * K + b * 32 + k);
        finite = finite && std::isfinite(v[k]);
        amax = std::max(amax, std::fabs(v[k]));
        sum += v[k];
      }
      const float s = amax / 16256.f;
      const float inv = finite && s > 0.f ? 1.f / s : 0.f;
      int8_t* hi = qx.hi.data() + r * K + b * 32;
      int8_t* lo = qx.lo.data() + r * K + b * 32;
      for (int k = 0; k < 32; ++k) {
        // |v| <= 16256 (+ rounding): clamp so a division rounding up cannot leave the range
        const int q = std::min(16256, std::max(-16256, static_cast<int>(std::nearbyint(v[k] * inv))));
        const int h = (q >= 0 ? q + 64 : q - 63) / 128;  // round(q / 128), halves away from zero
        hi[k] = static_cast<int8_t>(h);
        lo[k] = static_cast<int8_t>(q - 128 * h);
      }
      // an inf or NaN in the block: s is not finite and the block's products become NaN
      qx.s[r * KB8 + b] = finite ? s : std::numeric_limits<float>::quiet_NaN();
      qx.sx[r * KB8 + b] = sum;
    }
}

#if defined(SERVELAB_BLOCKS_AVX2)
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

static inline __m256 cvt8(const uint8_t* fp16) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(fp16))); }
#endif

}  // namespace blocks
}  // namespace servelab
