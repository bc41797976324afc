// The decode linears on a GGUF checkpoint's blocks as stored (Q4_1, Q8_0, Q5_0 here; the K-quants
// Q4_K and Q6_K in kquant_blocks.h), on any CPU: an
// AVX2 path (with FMA and F16C: x86-64-v3, the hosted CI runners, AMD cloud machines, laptops) and a
// scalar reference that builds with no x86 flags at all (an ARM machine gets a correct engine and a
// place for NEON in the same dispatch). engine/model/cpu_blocks.py is the Python side.
//
// GGUF blocks (uint8 [N, K / 32, block bytes], each output column's blocks in input order):
//   Q4_1 (20 bytes): d, m fp16; 16 bytes, input j in the low nibble of byte j, input j + 16 in the
//                    high one; w = d q + m, q in 0..15.
//   Q8_0 (34 bytes): d fp16; 32 int8; w = d q.
//   Q5_0 (22 bytes): d fp16; 4 bytes of fifth bits (bit j = input j); 16 bytes of nibbles as Q4_1;
//                    w = d (q - 16), q in 0..31.
// block_pack lays each column out once, at load time, as its KB blocks' quant bytes (Q4_1 16, Q8_0 32,
// Q5_0 20: the fifth bits, then the nibbles) followed by their d scales and (Q4_1) their m scales,
// each an fp16 array padded with zeros to KB8 = KB rounded up to 8: the same bytes per weight, but
// eight blocks' scales convert in one instruction (vcvtph2ps) and Q4_1's m sx terms of eight blocks
// in one multiply-add, where the blocks as stored took two scalar conversions per block.
// Activations: each row's 32-input block is written as s v_k with s = max_k |x_k| / 16256 and
// v_k = round(x_k / s) in [-16256, 16256] (about 14 bits, where llama.cpp's AVX2 path keeps 8),
// split v = 128 hi + lo with hi in [-127, 127], lo in [-64, 64]: two signed bytes per input. A block's
// integer sum over its 32 products is 128 A_hi + A_lo, exact in int32; per block and column
//   Q4_1: y += d s (128 A_hi + A_lo) + m sx          (sx: the block's float32 sum of x)
//   Q8_0: y += d s (128 A_hi + A_lo)
//   Q5_0: y += d s (128 A_hi + A_lo) - 16 d sx
// AVX2 has no byte dot product instruction (VNNI), so `vpmaddubsw` multiplies 32 unsigned weight bytes
// by 32 signed activation bytes into 16 saturating int16 pair sums, and `vpmaddwd` widens them into
// int32: Q4_1 / Q5_0's unsigned nibbles (<= 31) times a byte of at most 127 never saturate; Q8_0's
// signed weights go in as |q| with the sign moved onto the activation (`vpsignb`), at most
// 2 * 128 * 127 = 32512. The scalar path computes the same integers, so the two differ only in the
// order of the float32 sums. The one rounding beyond float32's is x's to 14 bits: at most s / 2 per
// input, 2^-15 of its block's largest |x| (bfloat16 keeps 2^-9 of each value); tests/test_cpu_blocks.py
// holds both paths against float64 with that bound.
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

}  // namespace blocks

// The instruction set this build multiplies blocks with: "avx2" or "scalar".
std::string block_linear_isa() {
#if defined(SERVELAB_BLOCKS_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// GGUF blocks uint8 [N, K / block weights, block bytes] -> the packed columns uint8 [N, column bytes]
// (module note; the K-quants' in kquant_blocks.h).
torch::Tensor block_pack(torch::Tensor w, std::string kind) {
  using blocks::Kind;
  const Kind k = blocks::kind_of(kind);
  const int64_t BB = blocks::block_bytes(k), BW = blocks::block_weights(k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 3 && w.size(2) == BB,
              "block_pack: GGUF blocks uint8 [N, K / ", BW, ", ", BB, "] for ", kind);
  auto src = w.contiguous();
  const int64_t N = src.size(0), NB = src.size(1), KB = NB * BW / 32, KB8 = blocks::padded8(KB);
  const int64_t CB = blocks::column_bytes(k, KB);
  auto out = torch::zeros({N, CB}, src.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint8_t* col = op + n * CB;
      const uint8_t* blk = sp + n * NB * BB;
      if (k == Kind::Q6_K) {
        std::memcpy(col, blk, NB * BB);  // as stored
      } else if (k == Kind::Q4_K) {
        for (int64_t b = 0; b < NB; ++b) blocks::pack_q4k(blk + b * BB, col + b * blocks::super_bytes(k));
      } else {
        const int64_t QB = blocks::quant_bytes(k);
        for (int64_t b = 0; b < KB; ++b, blk += BB) {
          std::memcpy(col + b * QB, blk + 2 * blocks::scale_count(k), QB);   // the quant bytes after the scales
          std::memcpy(col + KB * QB + 2 * b, blk, 2);                          // d
          if (k == Kind::Q4_1) std::memcpy(col + KB * QB + 2 * KB8 + 2 * b, blk + 2, 2);  // m
        }
      }
    }
  });
  return out;
}

// x [M, K] (float32 or bfloat16, contiguous) @ the packed columns' matrix [N, K].T -> [M, N] in x's
// dtype. `scalar`: the reference path even where the build has AVX2 (tests compare the two).
torch::Tensor block_linear(torch::Tensor x, torch::Tensor w, std::string kind, bool scalar) {
  using blocks::Kind;
  check_cpu(x, "block_linear x");
  const Kind k = blocks::kind_of(kind);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "block_linear: x [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t BW = blocks::block_weights(k);
  TORCH_CHECK(K % BW == 0, "block_linear: K (", K, ") must be a multiple of ", BW, " for ", kind);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == blocks::column_bytes(k, K / 32),
              "block_linear: packed columns uint8 [N, ", blocks::column_bytes(k, K / 32), "] (block_pack of ", kind,
              " blocks of K = ", K, " inputs), got ", w.sizes());
  const int64_t N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  SERVELAB_DISPATCH(x, [&] {
    blocks::QuantX qx;
    blocks::quantize_x(x.data_ptr<scalar_t>(), M, K, qx);
    scalar_t* yp = y.data_ptr<scalar_t>();
    // Rows in groups of 4 (the AVX2 path's register budget); each group streams the weights once.
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int64_t m = std::min<int64_t>(4, M - r0);
      const blocks::QuantX part = M <= 4 ? blocks::QuantX() : blocks::rows_of(qx, r0, m);
      const blocks::QuantX& q = M <= 4 ? qx : part;
      scalar_t* yr = yp + r0 * N;
      // 32 columns a grain: each thread streams a contiguous run of columns
      at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
        switch (k) {
          case Kind::Q4_1: blocks::run_columns<Kind::Q4_1>(q, wp, yr, m, N, n0, n1, scalar); break;
          case Kind::Q8_0: blocks::run_columns<Kind::Q8_0>(q, wp, yr, m, N, n0, n1, scalar); break;
          case Kind::Q5_0: blocks::run_columns<Kind::Q5_0>(q, wp, yr, m, N, n0, n1, scalar); break;
          case Kind::Q4_K: blocks::kquant_run_columns<Kind::Q4_K>(q, wp, yr, m, N, n0, n1, scalar); break;
          case Kind::Q6_K: blocks::kquant_run_columns<Kind::Q6_K>(q, wp, yr, m, N, n0, n1, scalar); break;
        }
      });
    }
  });
  return y;
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("block_linear(Tensor x, Tensor packed, str kind, bool scalar=False) -> Tensor");
  m.def("block_pack(Tensor blocks, str kind) -> Tensor");
  m.def("block_linear_isa() -> str", &servelab::block_linear_isa);
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("block_linear", &servelab::block_linear);
  m.impl("block_pack", &servelab::block_pack);
}
