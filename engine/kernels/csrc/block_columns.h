// The column loops of the decode linears on a GGUF checkpoint's blocks (block_linear.cpp's note has the
// layouts and the arithmetic): the scalar reference, the AVX2 path and `run_columns`, which picks one
// for a range of output columns. block_linear.cpp runs them under at::parallel_for, block_layers.cpp's
// team step on its team's share of the columns (team.h): a column's sums never depend on the split.
#pragma once
#include "block_quant.h"
#include "kquant_blocks.h"

namespace servelab {
namespace blocks {

// The weight of input k (0..31) of a packed block (its quant bytes `q`), as the integer its scale
// multiplies (Q4_1: 0..15, Q8_0: -128..127, Q5_0: 0..31 before the -16 that the sx term carries).
template <Kind K>
static inline int weight_q(const uint8_t* q, int k) {
  if constexpr (K == Kind::Q4_1) {
    return k < 16 ? q[k] & 15 : q[k - 16] >> 4;
  } else if constexpr (K == Kind::Q8_0) {
    return static_cast<int8_t>(q[k]);
  } else {
    const uint32_t high = static_cast<uint32_t>(q[0]) | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
    const int nib = k < 16 ? q[4 + k] & 15 : q[4 + k - 16] >> 4;
    return nib | static_cast<int>(((high >> k) & 1u) << 4);
  }
}

// A packed column's pieces: block b's quant bytes, its d and (Q4_1) m scales.
template <Kind K>
struct Column {
  const uint8_t* base;
  int64_t KB, KB8;
  const uint8_t* quant(int64_t b) const { return base + b * quant_bytes(K); }
  const uint8_t* d(int64_t b) const { return base + KB * quant_bytes(K) + 2 * b; }
  const uint8_t* m(int64_t b) const { return base + KB * quant_bytes(K) + 2 * KB8 + 2 * b; }
};

// The scalar reference: the same integers as the AVX2 path, summed in input order.
template <Kind K, typename T>
static void columns_scalar(const QuantX& qx, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  const int64_t KB = qx.KB, KB8 = qx.KB8, Kx = KB * 32, CB = column_bytes(K, KB);
  for (int64_t n = n0; n < n1; ++n) {
    const Column<K> col{w + n * CB, KB, KB8};
    for (int64_t r = 0; r < M; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < KB; ++b) {
        const int8_t* hi = qx.hi.data() + r * Kx + b * 32;
        const int8_t* lo = qx.lo.data() + r * Kx + b * 32;
        int32_t isum = 0;
        for (int k = 0; k < 32; ++k) isum += weight_q<K>(col.quant(b), k) * (128 * hi[k] + lo[k]);
        const float d = half_to_float(col.d(b)), s = qx.s[r * KB8 + b], sx = qx.sx[r * KB8 + b];
        if constexpr (K == Kind::Q4_1) acc += d * s * static_cast<float>(isum) + half_to_float(col.m(b)) * sx;
        if constexpr (K == Kind::Q8_0) acc += d * s * static_cast<float>(isum);
        if constexpr (K == Kind::Q5_0) acc += d * (s * static_cast<float>(isum) - 16.f * sx);
      }
      st(y, r * N + n, acc);
    }
  }
}

#if defined(SERVELAB_BLOCKS_AVX2)
// A packed block's 32 weights as bytes in input order: unsigned (Q4_1 0..15, Q5_0 0..31), or for
// Q8_0 the signed bytes (the caller takes |q| and moves the sign onto x).
template <Kind K>
static inline __m256i weight_bytes(const uint8_t* q) {
  if constexpr (K == Kind::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (K == Kind::Q4_1 ? 0 : 4)));
    const __m128i m4 = _mm_set1_epi8(15);
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    if constexpr (K == Kind::Q5_0) {  // bit k of the 32-bit word -> 16 into byte k
      uint32_t high;
      std::memcpy(&high, q, 4);
      const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
      __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(high)), shuf);
      const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
      bytes = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);  // 0xFF where the bit is set
      w = _mm256_or_si256(w, _mm256_and_si256(bytes, _mm256_set1_epi8(16)));
    }
    return w;
  }
}


// C columns n .. n + C against M rows: C * M float accumulators of 8 lanes. Per eight blocks, their d
// scales times x's s in one multiply (ds), Q4_1's m sx (Q5_0's -16 d sx) terms in one multiply-add
// into a side accumulator; per block, the int32 sums (128 A_hi + A_lo) turned to float and
// multiply-added with the block's ds.
template <Kind K, int M, int C, typename T>
static inline void columns_avx2(const QuantX& qx, const uint8_t* w, T* y, int64_t N, int64_t n, int64_t n_end) {
  const int64_t KB = qx.KB, KB8 = qx.KB8, Kx = KB * 32, CB = column_bytes(K, KB);
  // The weights stream from memory: while this group's blocks are multiplied, the group kAhead
  // groups on is prefetched, its cache lines spread over the block loop (the hardware prefetcher
  // alone left a step's matrices at about half the speed they run from cache).
  constexpr int64_t kAhead = 2;
  const int64_t lines = (C * CB + 63) / 64;
  const uint8_t* ahead = n + (kAhead + 1) * C <= n_end ? w + (n + kAhead * C) * CB : nullptr;
  Column<K> col[C];
  for (int c = 0; c < C; ++c) col[c] = Column<K>{w + (n + c) * CB, KB, KB8};
  __m256 acc[C][M], side[C][M];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) acc[c][r] = side[c][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), c128 = _mm256_set1_epi16(128);
  alignas(32) float ds[C][M][8];
  for (int64_t b8 = 0; b8 < KB; b8 += 8) {
    for (int c = 0; c < C; ++c) {
      const __m256 d = cvt8(col[c].d(b8));
      for (int r = 0; r < M; ++r) {
        const __m256 s = _mm256_loadu_ps(qx.s.data() + r * KB8 + b8);
        const __m256 sx = _mm256_loadu_ps(qx.sx.data() + r * KB8 + b8);
        _mm256_store_ps(ds[c][r], _mm256_mul_ps(d, s));
        if constexpr (K == Kind::Q4_1) side[c][r] = _mm256_fmadd_ps(cvt8(col[c].m(b8)), sx, side[c][r]);
        if constexpr (K == Kind::Q5_0) side[c][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(-16.f)), sx, side[c][r]);
      }
    }
    const int64_t b_end = std::min<int64_t>(KB, b8 + 8);
    for (int64_t b = b8; b < b_end; ++b) {
      if (ahead != nullptr)
        for (int64_t l = b * lines / KB; l < (b + 1) * lines / KB; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + l * 64), _MM_HINT_T0);
      __m256i hi[M], lo[M];
      for (int r = 0; r < M; ++r) {
        hi[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.hi.data() + r * Kx + b * 32));
        lo[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.lo.data() + r * Kx + b * 32));
      }
      for (int c = 0; c < C; ++c) {
        __m256i wq = weight_bytes<K>(col[c].quant(b));
        if constexpr (K == Kind::Q8_0) {
          const __m256i sgn = wq;
          wq = _mm256_sign_epi8(wq, wq);  // |q| (128 for -128: taken as unsigned below)
          for (int r = 0; r < M; ++r) {
            const __m256i ph = _mm256_maddubs_epi16(wq, _mm256_sign_epi8(hi[r], sgn));
            const __m256i pl = _mm256_maddubs_epi16(wq, _mm256_sign_epi8(lo[r], sgn));
            const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(ph, c128), _mm256_madd_epi16(pl, ones));
            acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(&ds[c][r][b - b8]), acc[c][r]);
          }
        } else {
          for (int r = 0; r < M; ++r) {
            const __m256i ph = _mm256_maddubs_epi16(wq, hi[r]);
            const __m256i pl = _mm256_maddubs_epi16(wq, lo[r]);
            const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(ph, c128), _mm256_madd_epi16(pl, ones));
            acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(&ds[c][r][b - b8]), acc[c][r]);
          }
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) st(y, r * N + n + c, hsum8(_mm256_add_ps(acc[c][r], side[c][r])));
}

// Columns [n0, n1) for M rows (M <= 4 at a time; more rows in groups of up to 4): C columns at a
// time where few rows leave registers free (independent accumulators hide the FMA latency).
template <Kind K, int M, typename T>
static void columns_rows(const QuantX& qx, const uint8_t* w, T* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int C = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + C <= n1; n += C) columns_avx2<K, M, C>(qx, w, y, N, n, n1);
  for (; n < n1; ++n) columns_avx2<K, M, 1>(qx, w, y, N, n, n1);
}
#endif

// Rows [r0, r0 + m) of the quantised x (copies the few bytes: x is small).
static QuantX rows_of(const QuantX& qx, int64_t r0, int64_t m) {
  QuantX out;
  const int64_t Kx = qx.KB * 32;
  out.KB = qx.KB;
  out.KB8 = qx.KB8;
  out.hi.assign(qx.hi.begin() + r0 * Kx, qx.hi.begin() + (r0 + m) * Kx);
  out.lo.assign(qx.lo.begin() + r0 * Kx, qx.lo.begin() + (r0 + m) * Kx);
  out.s.assign(qx.s.begin() + r0 * qx.KB8, qx.s.begin() + (r0 + m) * qx.KB8);
  out.sx.assign(qx.sx.begin() + r0 * qx.KB8, qx.sx.begin() + (r0 + m) * qx.KB8);
  return out;
}

template <Kind K, typename T>
static void run_columns(const QuantX& qx, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t n0, int64_t n1, bool scalar) {
#if defined(SERVELAB_BLOCKS_AVX2)
  if (!scalar) {
    switch (M) {
      case 1: return columns_rows<K, 1>(qx, w, y, N, n0, n1);
      case 2: return columns_rows<K, 2>(qx, w, y, N, n0, n1);
      case 3: return columns_rows<K, 3>(qx, w, y, N, n0, n1);
      case 4: return columns_rows<K, 4>(qx, w, y, N, n0, n1);
      default: break;
    }
  }
#endif
  (void)scalar;
  columns_scalar<K>(qx, w, y, M, N, n0, n1);
}

// Columns [n0, n1) of a linear on blocks of kind `k` (the K-quants' loops in kquant_blocks.h).
template <typename T>
static void run_kind(Kind k, const QuantX& qx, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t n0, int64_t n1,
                     bool scalar) {
  switch (k) {
    case Kind::Q4_1: return run_columns<Kind::Q4_1>(qx, w, y, M, N, n0, n1, scalar);
    case Kind::Q8_0: return run_columns<Kind::Q8_0>(qx, w, y, M, N, n0, n1, scalar);
    case Kind::Q5_0: return run_columns<Kind::Q5_0>(qx, w, y, M, N, n0, n1, scalar);
    case Kind::Q4_K: return kquant_run_columns<Kind::Q4_K>(qx, w, y, M, N, n0, n1, scalar);
    case Kind::Q6_K: return kquant_run_columns<Kind::Q6_K>(qx, w, y, M, N, n0, n1, scalar);
  }
}

// y [M, N] = x's quantized rows `qx` times the packed columns `w` of kind `k`: rows in groups of 4 (the
// AVX2 path's register budget; each group streams the weights once), each group's columns [0, N) handed
// to `split(run)`, which calls run(n0, n1) over ranges that cover them once (at::parallel_for's, a team's).
template <typename T, class Split>
static void linear_columns(const QuantX& qx, const uint8_t* w, T* y, int64_t M, int64_t N, Kind k, bool scalar,
                           const Split& split) {
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const int64_t m = std::min<int64_t>(4, M - r0);
    const QuantX part = M <= 4 ? QuantX() : rows_of(qx, r0, m);
    const QuantX& q = M <= 4 ? qx : part;
    T* yr = y + r0 * N;
    split([&](int64_t n0, int64_t n1) { run_kind(k, q, w, yr, m, N, n0, n1, scalar); });
  }
}

}  // namespace blocks

}  // namespace servelab
