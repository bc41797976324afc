// The decode linears on a GGUF checkpoint's own blocks (Q4_1, Q8_0): each weight read as stored
// (5 or 8.5 bits instead of bfloat16's 16) and widened in registers to the very bfloat16 value the
// loader made of it, so the results are those of the bfloat16 kernel (amx_linear.cpp), bit for bit.
//
// The loader's values: Q4_1 w = bf16(float(d) * q + float(m)) (a product, then a sum, each rounded
// to float32; then round to nearest even), Q8_0 w = bf16(float(d) * q). Here: one fused
// multiply-add (Q4_1) or a multiply (Q8_0), then vcvtne2ps2bf16 (round to nearest even). Both are
// the same numbers: d has 11 significant bits and q at most 8, so d * q is exact in float32 and
// rounding it first changes nothing; the values are never float32 denormals. quant_pack checks
// every packed weight through the very widening the kernel runs, against the loaded weight.
//
// Packed layout (quant_pack), per 32-column block nb and 32-input block kb (kb = the GGUF block of
// every column), "tiles" of 16 columns (half h: columns 32 nb + 16 h .. + 16, or with interleave I
// the gate columns 16 nb .. + 16 (h = 0) and the same up columns (h = 1)):
//   Q4_1 (640 bytes): d[h=0] 16 x fp16, m[h=0], d[h=1], m[h=1]; then per input pair k2 = 0..15,
//        for h = 0, 1: 16 bytes, byte b = lane b of the "low" vector (column b / 2, input 2 k2 + b % 2)
//        in its low nibble and lane b of the "high" vector (column 8 + b / 2) in its high nibble.
//   Q8_0 (1088 bytes): d[h=0], d[h=1] 16 x fp16; then per k2, for h = 0, 1: 16 int8 of the low
//        vector's lanes, 16 of the high vector's.
// Widened and rounded, vcvtne2ps2bf16(high, low) puts column c's pair (inputs 2 k2, 2 k2 + 1) in
// 32-bit lane c: exactly the word the bfloat16 kernel's packed layout holds there.
#pragma once
#include "kernel_header.h"
#include <algorithm>
#include <atomic>

namespace servelab {

enum class BlockKind : int { Q4_1 = 0, Q8_0 = 1 };

// GGUF block sizes (bytes per 32 weights) and packed tile sizes (bytes per 32 columns x 32 inputs).
static inline int64_t gguf_block_bytes(BlockKind k) { return k == BlockKind::Q4_1 ? 20 : 34; }
static inline int64_t packed_tile_bytes(BlockKind k) { return k == BlockKind::Q4_1 ? 640 : 1088; }
static inline int packed_kind(int64_t tile_bytes) { return tile_bytes == 640 ? 0 : tile_bytes == 1088 ? 1 : -1; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SERVELAB_GGUF_BLOCKS 1

// The 16 columns of one half-tile, their scales widened to the two vectors' lane order
// (lane j: column j / 2 of the low vector, 8 + j / 2 of the high one).
struct HalfScales {
  __m512 d_lo, d_hi, m_lo, m_hi;
};

static inline HalfScales half_scales(const uint8_t* d16, const uint8_t* m16) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  HalfScales s;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d16)));
  s.d_lo = _mm512_permutexvar_ps(lo, d);
  s.d_hi = _mm512_permutexvar_ps(hi, d);
  if (m16 != nullptr) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m16)));
    s.m_lo = _mm512_permutexvar_ps(lo, m);
    s.m_hi = _mm512_permutexvar_ps(hi, m);
  } else {
    s.m_lo = s.m_hi = _mm512_setzero_ps();
  }
  return s;
}

// One input pair of a half-tile as 16 bfloat16 pairs (16 columns x inputs 2 k2, 2 k2 + 1).
template <BlockKind K>
static inline __m512bh widen_pair(const uint8_t* p, const HalfScales& s) {
  __m512 lo, hi;
  if constexpr (K == BlockKind::Q4_1) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // float(nibble)
    lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, q), s.d_lo, s.m_lo);  // vpermd reads the low 4 bits
    hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), q), s.d_hi, s.m_hi);
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    lo = _mm512_mul_ps(lo, s.d_lo);
    hi = _mm512_mul_ps(hi, s.d_hi);
  }
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <BlockKind K>
struct TileLayout {
  static constexpr int64_t kBytes = K == BlockKind::Q4_1 ? 640 : 1088;
  static constexpr int64_t kHead = K == BlockKind::Q4_1 ? 128 : 64;  // the scales
  static constexpr int64_t kPair = K == BlockKind::Q4_1 ? 16 : 32;   // one half's bytes per input pair
  static const uint8_t* d(const uint8_t* t, int h) { return t + h * (kHead / 2); }
  static const uint8_t* m(const uint8_t* t, int h) { return K == BlockKind::Q4_1 ? t + h * 64 + 32 : nullptr; }
  static const uint8_t* pair(const uint8_t* t, int k2, int h) { return t + kHead + (2 * k2 + h) * kPair; }
};

// R rows of x (their bfloat16 pairs as 32-bit words, KW a row) against one 32-column block, 2 R
// accumulators of 16 columns in registers over the whole reduction: for each 32-input step kc,
// src.step(kc) gives the block's weights there, whose pairs(k2, w0, w1) are the bfloat16 pairs of
// inputs 2 k2, 2 k2 + 1 for columns 0-15 (w0) and 16-31 (w1); each row's pair is broadcast and
// multiply-added into both. Row j lands where the AMX tiles would store it (c[j / 16][h], row
// j % 16). The bfloat16 kernel (amx_linear.cpp) and the widened blocks both run this loop, so
// their sums are the same in the same order.
template <int R, typename Source>
static inline void dp_rows(const uint32_t* xw, int64_t KW, int64_t KC, float* cf, int j0, const Source& src) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < KC; ++kc) {
    const auto step = src.step(kc);
    const uint32_t* xk = xw + kc * 16;
    for (int k2 = 0; k2 < 16; ++k2) {
      __m512bh w0, w1;
      step.pairs(k2, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[r * KW + k2]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int j = j0 + r;
    _mm512_store_ps(cf + ((j / 16) * 2) * 256 + (j % 16) * 16, acc[r][0]);
    _mm512_store_ps(cf + ((j / 16) * 2 + 1) * 256 + (j % 16) * 16, acc[r][1]);
  }
}

template <int N, typename Source>
static inline void dp_rows_tail(const uint32_t* xw, int64_t KW, int64_t KC, float* cf, int j, int n, const Source& src) {
  if constexpr (N > 0) {
    if (n == N)
      dp_rows<N>(xw + j * KW, KW, KC, cf, j, src);
    else
      dp_rows_tail<N - 1>(xw, KW, KC, cf, j, n, src);
  }
}

// dp_rows over `rows` rows of x (up to 32) in groups of G, then the remainder: the first group
// reads `first` (a source that may prefetch the next block), the others `rest`.
template <int G, typename Source>
static inline void dp_row_groups(const uint32_t* xw, int64_t KW, int64_t KC, float* cf, int rows, const Source& first,
                                 const Source& rest) {
  int j = 0;
  for (; j + G <= rows; j += G) dp_rows<G>(xw + j * KW, KW, KC, cf, j, j == 0 ? first : rest);
  dp_rows_tail<G - 1>(xw, KW, KC, cf, j, rows - j, j == 0 ? first : rest);
}

// One 32-column block of KB widened tiles as dp_rows reads it. No software prefetch: the widening,
// not the stream, sets the pace here, and the hardware's prefetcher keeps up (prefetching the
// next block into L2, as the bfloat16 kernel does, measured no faster on a Zen 4).
template <BlockKind K>
struct WidenedTiles {
  using L = TileLayout<K>;
  const uint8_t* wb;
  struct Step {
    const uint8_t* t;
    HalfScales s0, s1;
    void pairs(int k2, __m512bh& w0, __m512bh& w1) const {
      w0 = widen_pair<K>(L::pair(t, k2, 0), s0);
      w1 = widen_pair<K>(L::pair(t, k2, 1), s1);
    }
  };
  Step step(int64_t kb) const {
    const uint8_t* t = wb + kb * L::kBytes;
    return Step{t, half_scales(L::d(t, 0), L::m(t, 0)), half_scales(L::d(t, 1), L::m(t, 1))};
  }
};

// Rows from 16 mt on (up to 32; x's rows are never copied: only whole rows are read) in groups
// of at most 8 (16 accumulators).
template <BlockKind K>
static inline void widened_block(const bf16* x, int64_t M, int64_t Kdim, int64_t mt, const uint8_t* wb, int64_t KB,
                                 float* cf) {
  const WidenedTiles<K> src{wb};
  const int rows = static_cast<int>(std::min<int64_t>(32, M - mt * 16));
  dp_row_groups<8>(reinterpret_cast<const uint32_t*>(x + mt * 16 * Kdim), Kdim / 2, KB, cf, rows, src, src);
}

// blocks [N, KB, gguf bytes] (uint8, the GGUF tensor's rows in w's row order) -> the packed
// layout above, checking every weight against w [N, 32 KB] bfloat16: the pack is only made where
// the blocks reproduce the loaded weights exactly (else a RuntimeError names the first mismatch).
static torch::Tensor pack_gguf_blocks(const torch::Tensor& blocks, const torch::Tensor& w, BlockKind kind,
                                      int64_t interleave) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 3 &&
                  blocks.size(2) == gguf_block_bytes(kind),
              "blocks: [N, KB, ", gguf_block_bytes(kind), "] uint8 on the CPU");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2 &&
                  w.size(0) == blocks.size(0) && w.size(1) == 32 * blocks.size(1),
              "w: [N, 32 KB] bfloat16, the blocks' weights");
  const auto bl = blocks.contiguous();
  const auto wc = w.contiguous();
  const int64_t N = w.size(0), KB = blocks.size(1), I = interleave;
  TORCH_CHECK(I == 0 || (N == 2 * I && I % 16 == 0), "quant_pack: interleave I needs N = 2 I and 16 | I");
  const int64_t NB = I ? I / 16 : (N + 31) / 32, T = packed_tile_bytes(kind), G = gguf_block_bytes(kind);
  auto out = torch::zeros({NB, KB, T}, blocks.options());
  const uint8_t* src = bl.data_ptr<uint8_t>();
  const uint16_t* wv = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t head = kind == BlockKind::Q4_1 ? 128 : 64, pair = kind == BlockKind::Q4_1 ? 16 : 32;
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint8_t* t = o + (nb * KB + kb) * T;
        for (int h = 0; h < 2; ++h)
          for (int n = 0; n < 16; ++n) {
            const int64_t col = I ? h * I + nb * 16 + n : nb * 32 + h * 16 + n;
            if (col >= N) continue;  // zero scales: zero weights
            const uint8_t* blk = src + (col * KB + kb) * G;
            uint8_t* dm = t + h * (head / 2);
            std::memcpy(dm + 2 * n, blk, 2);                                          // d
            if (kind == BlockKind::Q4_1) std::memcpy(dm + 32 + 2 * n, blk + 2, 2);  // m
            for (int k = 0; k < 32; ++k) {
              // the value at (col, 32 kb + k) lands in lane 2 (n % 8) + k % 2 of pair k / 2's low or high vector
              const int k2 = k / 2, lane = 2 * (n % 8) + k % 2;
              uint8_t* p = t + head + (2 * k2 + h) * pair;
              if (kind == BlockKind::Q4_1) {
                const uint8_t byte = blk[4 + (k & 15)];
                const uint8_t q = k < 16 ? byte & 15 : byte >> 4;
                p[lane] |= n < 8 ? q : static_cast<uint8_t>(q << 4);
              } else {
                p[(n < 8 ? 0 : 16) + lane] = blk[2 + k];
              }
            }
          }
      }
  });
  // Every packed weight through the kernel's own widening, against w's bfloat16 bits.
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint16_t got[32];
    for (int64_t nb = b0; nb < b1 && bad.load(std::memory_order_relaxed) < 0; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint8_t* t = o + (nb * KB + kb) * T;
        for (int h = 0; h < 2; ++h) {
          const uint8_t* m16 = kind == BlockKind::Q4_1 ? t + h * 64 + 32 : nullptr;
          const HalfScales sc = half_scales(t + h * (head / 2), m16);
          for (int k2 = 0; k2 < 16; ++k2) {
            const uint8_t* p = t + head + (2 * k2 + h) * pair;
            const __m512bh v = kind == BlockKind::Q4_1 ? widen_pair<BlockKind::Q4_1>(p, sc) : widen_pair<BlockKind::Q8_0>(p, sc);
            _mm512_store_si512(got, (__m512i)v);
            for (int n = 0; n < 16; ++n) {
              const int64_t col = I ? h * I + nb * 16 + n : nb * 32 + h * 16 + n;
              for (int e = 0; e < 2; ++e) {
                const int64_t at = col * 32 * KB + 32 * kb + 2 * k2 + e;
                if (col < N ? got[2 * n + e] != wv[at] : got[2 * n + e] != 0) {
                  int64_t none = -1;
                  bad.compare_exchange_strong(none, col < N ? at : 0);
                }
              }
            }
          }
        }
      }
  });
  const int64_t at = bad.load();
  TORCH_CHECK(at < 0, "quant_pack: the blocks do not reproduce the weight at row ", at / (32 * KB), ", column ",
              at % (32 * KB));
  return out;
}
#endif

}  // namespace servelab
