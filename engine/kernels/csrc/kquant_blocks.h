// The decode linears on a GGUF checkpoint's K-quant super-blocks (Q4_K, Q6_K) as stored, on AVX2 or
// by the scalar reference: block_linear.cpp's op calls them for these kinds, with x quantised as for
// the 32-weight kinds (block_quant.h: per 32-input block, s v_k with v = 128 hi + lo, about 14 bits).
// A super-block holds 256 weights of one column, so eight of x's blocks line up with each one.
//
// GGUF super-blocks (uint8 [N, K / 256, bytes], gguf.quants' layouts):
//   Q4_K (144 bytes): d, dmin fp16; 12 bytes packing eight 6-bit scales sc_j and mins m_j (j < 4:
//        sc_j = b[j] & 63, m_j = b[j + 4] & 63; j >= 4: sc_j = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4,
//        m_j = (b[j + 4] >> 4) | (b[j] >> 6) << 4); 128 bytes of nibbles: sub-blocks 2i and 2i + 1
//        (32 inputs each) in the low and high nibbles of bytes 32 i .. 32 i + 31;
//        w = d sc_j q - dmin m_j, q in 0..15.
//   Q6_K (210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 inputs), d fp16. Input
//        128 h + 32 t + l (h < 2, t < 4, l < 32): low four bits from ql[64 h + 32 (t & 1) + l] (the
//        low nibble for t < 2, the high one for t >= 2), high two from qh[32 h + l] >> 2 t;
//        w = d sc (q - 32), q in 0..63.
// block_pack keeps Q6_K's super-blocks as stored; Q4_K's it writes as d, dmin, the eight sc_j and the
// eight m_j as bytes, then the 128 nibble bytes (148 bytes: the scales' bit-fiddling done once, at
// load time, for 4 bytes more per 256 weights). Per super-block, column and row (A_j: the integer
// sum sum_k q_k v_k over x's block j, exact in int32):
//   Q4_K: y += sum_j (d sc_j) s_j A_j - (dmin m_j) sx_j             (sx_j: x's float32 sum there)
//   Q6_K: y += sum_j d s_j (sc_a sum_{k<16} (q_k - 32) v_k + sc_b sum_{k>=16} (q_k - 32) v_k)
// On AVX2, Q4_K's nibbles are `vpmaddubsw`'s unsigned bytes, as Q4_1's are. Q6_K's q - 32 goes in as
// |q - 32| (<= 32) with its sign moved onto x's bytes, as Q8_0's does, pair sums at most
// 2 * 32 * 127 = 8128; `vpmaddwd` then multiplies each 16-input half by its own scale (hi's by
// 128 sc, at most 16384 in magnitude: an int16) and adds pairs, so the two scales of a block cost no
// extra instruction. The offset -32 rides in the integers, not in an sx term. The scalar path sums
// the same integers (int64, then float32), in input order.
#pragma once
#include "block_quant.h"

namespace servelab {
namespace blocks {

// Q4_K as block_pack writes it (148 bytes): d, dmin, sc[8], m[8], qs[128].
static constexpr int64_t kQ4kScales = 4, kQ4kMins = 12, kQ4kQuants = 20;
// Q6_K as stored (210 bytes): ql[128], qh[64], sc[16] (int8), d.
static constexpr int64_t kQ6kHigh = 128, kQ6kScales = 192, kQ6kD = 208;

// One GGUF Q4_K super-block (144 bytes) -> its packed form (148 bytes).
static inline void pack_q4k(const uint8_t* src, uint8_t* dst) {
  const uint8_t* b = src + 4;
  std::memcpy(dst, src, 4);  // d, dmin
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? b[j] & 63 : (b[j + 4] & 15) | ((b[j - 4] >> 6) << 4);
    const int m = j < 4 ? b[j + 4] & 63 : (b[j + 4] >> 4) | ((b[j] >> 6) << 4);
    dst[kQ4kScales + j] = static_cast<uint8_t>(sc);
    dst[kQ4kMins + j] = static_cast<uint8_t>(m);
  }
  std::memcpy(dst + kQ4kQuants, src + 16, 128);
}

// Input k (0..31) of sub-block j (0..7) of a packed super-block, as the integer its scale multiplies
// (Q4_K: 0..15; Q6_K: q - 32 in -32..31).
template <Kind K>
static inline int kquant_q(const uint8_t* sb, int j, int k) {
  if constexpr (K == Kind::Q4_K) {
    return (sb[kQ4kQuants + 32 * (j / 2) + k] >> (4 * (j & 1))) & 15;
  } else {
    const int h = j / 4, t = j % 4;
    const int low = (sb[64 * h + 32 * (t & 1) + k] >> (4 * (t >> 1))) & 15;
    const int high = (sb[kQ6kHigh + 32 * h + k] >> (2 * t)) & 3;
    return (low | (high << 4)) - 32;
  }
}

template <Kind K, typename T>
static void kquant_columns_scalar(const QuantX& qx, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t n0,
                                  int64_t n1) {
  const int64_t KB = qx.KB, KB8 = qx.KB8, Kx = KB * 32, SB = super_bytes(K), CB = column_bytes(K, KB);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; ++r) {
      float acc = 0.f;
      for (int64_t b8 = 0; b8 < KB; b8 += 8) {
        const uint8_t* sb = w + n * CB + b8 / 8 * SB;
        for (int j = 0; j < 8; ++j) {
          const int64_t b = b8 + j;
          const int8_t* hi = qx.hi.data() + r * Kx + b * 32;
          const int8_t* lo = qx.lo.data() + r * Kx + b * 32;
          const float s = qx.s[r * KB8 + b];
          if constexpr (K == Kind::Q4_K) {
            int32_t isum = 0;
            for (int k = 0; k < 32; ++k) isum += kquant_q<K>(sb, j, k) * (128 * hi[k] + lo[k]);
            const float dsc = half_to_float(sb) * static_cast<float>(sb[kQ4kScales + j]);
            const float dm = half_to_float(sb + 2) * static_cast<float>(sb[kQ4kMins + j]);
            acc += dsc * s * static_cast<float>(isum) - dm * qx.sx[r * KB8 + b];
          } else {
            const int8_t* sc = reinterpret_cast<const int8_t*>(sb + kQ6kScales) + 2 * j;
            int64_t isum = 0;
            for (int k = 0; k < 32; ++k) isum += sc[k / 16] * kquant_q<K>(sb, j, k) * (128 * hi[k] + lo[k]);
            acc += half_to_float(sb + kQ6kD) * s * static_cast<float>(isum);
          }
        }
      }
      st(y, r * N + n, acc);
    }
}

#if defined(SERVELAB_BLOCKS_AVX2)
// Sub-block j's 32 weights of a packed super-block as bytes in input order: Q4_K's nibbles (0..15),
// Q6_K's q - 32 (signed, -32..31).
template <Kind K>
static inline __m256i kquant_bytes(const uint8_t* sb, int j) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if constexpr (K == Kind::Q4_K) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ4kQuants + 32 * (j / 2)));
    return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, m4);
  } else {
    const int h = j / 4, t = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ6kHigh + 32 * h));
    const __m256i low = _mm256_and_si256(t >> 1 ? _mm256_srli_epi16(ql, 4) : ql, m4);
    // (qh >> 2t) & 3 per byte (16-bit shifts: the bits kept never cross a byte), then << 4
    const __m256i two = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(two, 4)), _mm256_set1_epi8(32));
  }
}

// C columns n .. n + C against M rows, as block_linear.cpp's columns_avx2: per super-block, the eight
// blocks' float scales of each column and row in one multiply (ds), Q4_K's -dmin m_j sx_j in one
// multiply-add into a side accumulator; per block, the int32 sums turned to float and multiply-added.
template <Kind K, int M, int C, typename T>
static inline void kquant_columns_avx2(const QuantX& qx, const uint8_t* w, T* y, int64_t N, int64_t n, int64_t n_end) {
  const int64_t KB = qx.KB, KB8 = qx.KB8, Kx = KB * 32, SB = super_bytes(K), CB = column_bytes(K, KB);
  constexpr int64_t kAhead = 2;  // prefetch as columns_avx2 does (block_linear.cpp)
  const int64_t lines = (C * CB + 63) / 64;
  const uint8_t* ahead = n + (kAhead + 1) * C <= n_end ? w + (n + kAhead * C) * CB : nullptr;
  const uint8_t* col[C];
  for (int c = 0; c < C; ++c) col[c] = w + (n + c) * CB;
  __m256 acc[C][M], side[C][M];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) acc[c][r] = side[c][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), c128 = _mm256_set1_epi16(128);
  alignas(32) float ds[C][M][8];
  for (int64_t b8 = 0; b8 < KB; b8 += 8) {
    const uint8_t* sb[C];
    for (int c = 0; c < C; ++c) {
      sb[c] = col[c] + b8 / 8 * SB;
      __m256 dsc, dm = _mm256_setzero_ps();
      if constexpr (K == Kind::Q4_K) {
        const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb[c] + kQ4kScales));
        const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb[c] + kQ4kMins));
        dsc = _mm256_mul_ps(_mm256_set1_ps(half_to_float(sb[c])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)));
        dm = _mm256_mul_ps(_mm256_set1_ps(half_to_float(sb[c] + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)));
      } else {
        dsc = _mm256_set1_ps(half_to_float(sb[c] + kQ6kD));
      }
      for (int r = 0; r < M; ++r) {
        _mm256_store_ps(ds[c][r], _mm256_mul_ps(dsc, _mm256_loadu_ps(qx.s.data() + r * KB8 + b8)));
        if constexpr (K == Kind::Q4_K)
          side[c][r] = _mm256_fnmadd_ps(dm, _mm256_loadu_ps(qx.sx.data() + r * KB8 + b8), side[c][r]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = b8 + j;
      if (ahead != nullptr)
        for (int64_t l = b * lines / KB; l < (b + 1) * lines / KB; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + l * 64), _MM_HINT_T0);
      __m256i hi[M], lo[M];
      for (int r = 0; r < M; ++r) {
        hi[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.hi.data() + r * Kx + b * 32));
        lo[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.lo.data() + r * Kx + b * 32));
      }
      for (int c = 0; c < C; ++c) {
        const __m256i wq = kquant_bytes<K>(sb[c], j);
        if constexpr (K == Kind::Q4_K) {
          for (int r = 0; r < M; ++r) {
            const __m256i ph = _mm256_maddubs_epi16(wq, hi[r]);
            const __m256i pl = _mm256_maddubs_epi16(wq, lo[r]);
            const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(ph, c128), _mm256_madd_epi16(pl, ones));
            acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(&ds[c][r][j]), acc[c][r]);
          }
        } else {
          // int16 lanes 0-7 hold inputs 0-15 (scale sc_a), lanes 8-15 inputs 16-31 (sc_b)
          const int8_t* sc = reinterpret_cast<const int8_t*>(sb[c] + kQ6kScales) + 2 * j;
          const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
          const __m256i scv_hi = _mm256_slli_epi16(scv, 7);
          const __m256i aq = _mm256_sign_epi8(wq, wq);  // |q - 32| <= 32
          for (int r = 0; r < M; ++r) {
            const __m256i ph = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(hi[r], wq));
            const __m256i pl = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(lo[r], wq));
            const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(ph, scv_hi), _mm256_madd_epi16(pl, scv));
            acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(&ds[c][r][j]), acc[c][r]);
          }
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) st(y, r * N + n + c, hsum8(_mm256_add_ps(acc[c][r], side[c][r])));
}

template <Kind K, int M, typename T>
static void kquant_columns_rows(const QuantX& qx, const uint8_t* w, T* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int C = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + C <= n1; n += C) kquant_columns_avx2<K, M, C>(qx, w, y, N, n, n1);
  for (; n < n1; ++n) kquant_columns_avx2<K, M, 1>(qx, w, y, N, n, n1);
}
#endif

// Columns [n0, n1) of a K-quant matrix for M rows (M <= 4 on the AVX2 path; the caller groups rows).
template <Kind K, typename T>
static void kquant_run_columns(const QuantX& qx, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t n0, int64_t n1,
                               bool scalar) {
#if defined(SERVELAB_BLOCKS_AVX2)
  if (!scalar) {
    switch (M) {
      case 1: return kquant_columns_rows<K, 1>(qx, w, y, N, n0, n1);
      case 2: return kquant_columns_rows<K, 2>(qx, w, y, N, n0, n1);
      case 3: return kquant_columns_rows<K, 3>(qx, w, y, N, n0, n1);
      case 4: return kquant_columns_rows<K, 4>(qx, w, y, N, n0, n1);
      default: break;
    }
  }
#endif
  (void)scalar;
  kquant_columns_scalar<K>(qx, w, y, M, N, n0, n1);
}

}  // namespace blocks
}  // namespace servelab
