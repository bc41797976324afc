// The decode linears on a GGUF checkpoint's own blocks (Q4_1, Q8_0): each weight read as stored
// (5 or 8.5 bits instead of bfloat16's 16) and multiplied as the checkpoint defines it, unrounded.
//
// Per 32-input block of a column, sum_k x_k w_k = d sum_k q_k x_k + m sum_k x_k (Q4_1: w = d q + m,
// q a nibble; Q8_0: w = d q, q an int8, m = 0). The integers reach vdpbf16ps as bfloat16 words
// with one or two integer ops: bfloat16 counts by 1 in [128, 256), so the word 0x4300 | n is
// exactly 128 + n for a nibble n. A Q4_1 nibble is one such word; a Q8_0 byte q, as u = q + 128 =
// 16 a + b (its high nibble a = (byte >> 4) ^ 8, its low nibble b), two of them. With sx = sum_k x_k
// (float32, once per call and row) and A, B the block's vdpbf16ps sums over the words:
//   Q4_1: y += d (A - 128 sx) + m sx              = d A + (m - 128 d) sx
//   Q8_0: y += d (16 (A - 128 sx) + B - 256 sx)  = d (16 A + B) - 2304 d sx
// Widening 64 weights takes 4 integer ops (Q4_1) or 8 (Q8_0) where rounding each to the loader's
// bfloat16 value took ~18: at a few rows the stream, not the widening, sets the pace
// (docs/benchmarks.md). The results are the checkpoint's products in float32, rounded once at
// the end: closer to the exact sums than the bfloat16 kernel's (amx_linear.cpp), which multiplies
// bf16(d q + m), the loader's rounding of each weight; subtracting the 128 (2304) sx costs ~6 (~9)
// of float32's 24 bits. tests/test_gguf_blocks.py holds both against float64.
//
// Packed layout (quant_pack), per 32-column block nb and 32-input block kb (kb = the GGUF block of
// every column), two halves h of 16 columns (columns 32 nb + 16 h .. + 16, or with interleave I
// the gate columns 16 nb .. + 16 (h = 0) and the same up columns (h = 1)). A "line" is 32 bytes,
// byte b for word b of a half's 32-word vector: column b / 2, input 2 k2 + b % 2 (so vdpbf16ps sums
// column c in 32-bit lane c, as the bfloat16 kernel's packed layout has it).
//   Q4_1 (640 bytes): d[h=0] 16 x fp16 (column order), m[h=0], d[h=1], m[h=1]; then per input pair
//        k2 = 0..15 one line: half 0's nibble low, half 1's high.
//   Q8_0 (1088 bytes): d[h=0], d[h=1] 16 x fp16; then per k2 and h one line of int8.
// quant_pack checks every packed weight, rounded as the loader rounds it (bf16(float(d) q +
// float(m))), against the loaded bfloat16 weight: a pack is only made of the very blocks loaded.
#pragma once
#include "kernel_header.h"
#include <algorithm>
#include <atomic>
#include <vector>

namespace servelab {

enum class BlockKind : int { Q4_1 = 0, Q8_0 = 1 };

// GGUF block sizes (bytes per 32 weights); a packed tile's size (32 columns x 32 inputs) -> its kind.
static inline int64_t gguf_block_bytes(BlockKind k) { return k == BlockKind::Q4_1 ? 20 : 34; }
static inline int packed_kind(int64_t tile_bytes) { return tile_bytes == 640 ? 0 : tile_bytes == 1088 ? 1 : -1; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SERVELAB_GGUF_BLOCKS 1

// Nibbles to bfloat16 words 128 + n: (v & 15) | 0x4300 (one vpternlogd) and (v >> 4) ^ 0x4300
// (the bits do not overlap; with flip 8 the nibble's top bit turns over too).
static inline __m512i low_words(__m512i v) {
  return _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);  // (A & B) | C
}
static inline __m512i high_words(__m512i v, int16_t flip) {  // flip 8: the high nibble of q + 128
  return _mm512_xor_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi16(static_cast<int16_t>(0x4300 | flip)));
}
static inline __m512i line_bytes(const uint8_t* p) {  // 32 bytes, each zero-extended to a word
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <BlockKind K>
struct TileLayout {
  static constexpr bool kQ4 = K == BlockKind::Q4_1;
  static constexpr int64_t kBytes = kQ4 ? 640 : 1088;
  static constexpr int64_t kHead = kQ4 ? 128 : 64;  // the scales
  // Byte offsets in a tile: half h's d and m (Q4_1) scales (16 x fp16 each, column order), and the
  // line of input pair k2 (Q4_1: both halves' nibbles; Q8_0: half h's bytes).
  static constexpr int64_t d_at(int h) { return h * (kHead / 2); }
  static constexpr int64_t m_at(int h) { return h * 64 + 32; }
  static constexpr int64_t line_at(int k2, int h) { return kQ4 ? kHead + k2 * 32 : kHead + (2 * k2 + h) * 32; }
  // The weight at (half h, word b) of line k2, as the integer the scales multiply; and the bits a
  // stored byte of that line holds for integer q (Q4_1: OR-ed with the other half's nibble).
  static int q(const uint8_t* t, int k2, int h, int b) {
    const uint8_t byte = t[line_at(k2, h) + b];
    if constexpr (kQ4) return h == 0 ? byte & 15 : byte >> 4;
    return static_cast<int8_t>(byte);
  }
  static uint8_t bits(uint8_t q, int h) { return kQ4 && h == 1 ? static_cast<uint8_t>(q << 4) : q; }
};

// R rows of x (their bfloat16 pairs as 32-bit words, KW a row) against one 32-column block, 2 R
// accumulators of 16 columns in registers over the whole reduction: for each 32-input step kc,
// src.step(kc) gives the block's weights there, whose pairs(k2, w0, w1) are the bfloat16 pairs of
// inputs 2 k2, 2 k2 + 1 for columns 0-15 (w0) and 16-31 (w1); each row's pair is broadcast and
// multiply-added into both. Row j lands where the AMX tiles would store it (c[j / 16][h], row
// j % 16). The bfloat16 kernel's loop without AMX (amx_linear.cpp); the blocks' quant_rows below
// store their rows alike.
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

// R rows of x (bfloat16 pairs as 32-bit words, KW a row; sx: their float32 block sums, KB a row)
// against one 32-column block of KB tiles: per tile the block sums A (and B) per row and half in
// registers, then folded into the accumulators as the header says. Q4_1 at 1-2 rows keeps two
// interleaved chains of A (one chain is vdpbf16ps's latency, not its throughput); Q8_0's A and B
// are two chains already. Each tile asks for the lines kQuantPrefetch bytes further on in this
// thread's stream (its blocks are contiguous): on 2 Sapphire Rapids cores the hardware's
// prefetcher alone left SmolLM2's batch-1 step at 13-16 GB/s against `torch.sum`'s 25 (a Q8_0 LM
// head of 30 MB in 2.3 ms); with it and the packs on huge pages (forward_plan.on_huge_pages) the
// head takes 1.25 ms and the step 10.1 -> 7.2 ms (2,048 bytes; 1,024: 7.6, 4,096: 7.3-7.7, 8,192:
// 9.2; docs/benchmarks-log.md, 2026-12-06). On a Zen 4 prefetching the next block measured no
// faster. Rows land as dp_rows puts them.
constexpr int64_t kQuantPrefetch = 2048;  // bytes ahead in a thread's stream (quant_rows)

template <BlockKind K, int R>
static inline void quant_rows(const uint32_t* xw, int64_t KW, const float* sx, int64_t KB, float* cf, int j0,
                              const uint8_t* wb) {
  using L = TileLayout<K>;
  constexpr bool q4 = L::kQ4;
  constexpr int S = q4 && R <= 2 ? 2 : 1;  // chains of A per row and half
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* t = wb + kb * L::kBytes;
    const uint32_t* xk = xw + kb * 16;
    for (int64_t off = 0; off < L::kBytes; off += 64)  // this thread's stream, kQuantPrefetch bytes on
      _mm_prefetch(reinterpret_cast<const char*>(t + kQuantPrefetch + off), _MM_HINT_T0);
    __m512 A[S][R][2], B[q4 ? 1 : R][2];
    for (int r = 0; r < R; ++r) {
      for (int s = 0; s < S; ++s) A[s][r][0] = A[s][r][1] = _mm512_setzero_ps();
      if constexpr (!q4) B[r][0] = B[r][1] = _mm512_setzero_ps();
    }
    for (int k2 = 0; k2 < 16; k2 += S)
      for (int s = 0; s < S; ++s) {
        __m512i hi[2], lo[2];
        if constexpr (q4) {
          const __m512i v = line_bytes(t + L::line_at(k2 + s, 0));
          hi[0] = low_words(v);  // half 0: the low nibbles
          hi[1] = high_words(v, 0);
        } else {
          for (int h = 0; h < 2; ++h) {
            const __m512i v = line_bytes(t + L::line_at(k2 + s, h));
            hi[h] = high_words(v, 8);
            lo[h] = low_words(v);
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[r * KW + k2 + s]));
          for (int h = 0; h < 2; ++h) {
            A[s][r][h] = _mm512_dpbf16_ps(A[s][r][h], xv, (__m512bh)hi[h]);
            if constexpr (!q4) B[r][h] = _mm512_dpbf16_ps(B[r][h], xv, (__m512bh)lo[h]);
          }
        }
      }
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L::d_at(h))));
      __m512 dsx;  // the coefficient of sx
      if constexpr (q4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L::m_at(h))));
        dsx = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, m);  // m - 128 d
      } else {
        dsx = _mm512_mul_ps(_mm512_set1_ps(-2304.f), d);
      }
      for (int r = 0; r < R; ++r) {
        __m512 sum = A[0][r][h];
        for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, A[s][r][h]);
        if constexpr (!q4) sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(16.f), B[r][h]);
        acc[r][h] = _mm512_fmadd_ps(sum, d, acc[r][h]);
        acc[r][h] = _mm512_fmadd_ps(dsx, _mm512_set1_ps(sx[r * KB + kb]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int j = j0 + r;
    _mm512_store_ps(cf + ((j / 16) * 2) * 256 + (j % 16) * 16, acc[r][0]);
    _mm512_store_ps(cf + ((j / 16) * 2 + 1) * 256 + (j % 16) * 16, acc[r][1]);
  }
}

template <BlockKind K, int N>
static inline void quant_rows_tail(const uint32_t* xw, int64_t KW, const float* sx, int64_t KB, float* cf, int j,
                                   int n, const uint8_t* wb) {
  if constexpr (N > 0) {
    if (n == N)
      quant_rows<K, N>(xw + j * KW, KW, sx + j * KB, KB, cf, j, wb);
    else
      quant_rows_tail<K, N - 1>(xw, KW, sx, KB, cf, j, n, wb);
  }
}

// float32 sums of each row's 32-input blocks of x [M, K] (bfloat16): sx [M, K / 32].
static inline std::vector<float> block_sums(const bf16* x, int64_t M, int64_t K) {
  std::vector<float> sx(M * (K / 32));
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    float s = 0.f;
    for (int k = 0; k < 32; ++k) s += static_cast<float>(x[i * 32 + k]);
    sx[i] = s;
  }
  return sx;
}

// Rows from 16 mt on (up to 32; x's rows are never copied: only whole rows are read) in groups of
// at most G (Q4_1 4, Q8_0 3: the block sums and accumulators fill 16 and 18 registers), each group
// widening the block again (cheap enough).
template <BlockKind K>
static inline void widened_block(const bf16* x, const float* sx, int64_t M, int64_t Kdim, int64_t mt,
                                 const uint8_t* wb, int64_t KB, float* cf) {
  constexpr int G = K == BlockKind::Q4_1 ? 4 : 3;
  const int rows = static_cast<int>(std::min<int64_t>(32, M - mt * 16));
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x + mt * 16 * Kdim);
  const int64_t KW = Kdim / 2;
  const float* sxm = sx + mt * 16 * KB;
  int j = 0;
  for (; j + G <= rows; j += G) quant_rows<K, G>(xw + j * KW, KW, sxm + j * KB, KB, cf, j, wb);
  quant_rows_tail<K, G - 1>(xw, KW, sxm, KB, cf, j, rows - j, wb);
}

// blocks [N, KB, gguf bytes] (uint8, the GGUF tensor's rows in w's row order) -> the packed
// layout above, checking every weight against w [N, 32 KB] bfloat16: the pack is only made where
// the blocks reproduce the loaded weights exactly (else a RuntimeError names the first mismatch).
template <BlockKind K>
static torch::Tensor pack_gguf_blocks(const torch::Tensor& blocks, const torch::Tensor& w, int64_t interleave) {
  using L = TileLayout<K>;
  const int64_t G = gguf_block_bytes(K), T = L::kBytes;
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 3 &&
                  blocks.size(2) == G,
              "blocks: [N, KB, ", G, "] uint8 on the CPU");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2 &&
                  w.size(0) == blocks.size(0) && w.size(1) == 32 * blocks.size(1),
              "w: [N, 32 KB] bfloat16, the blocks' weights");
  const auto bl = blocks.contiguous();
  const auto wc = w.contiguous();
  const int64_t N = w.size(0), KB = blocks.size(1), I = interleave;
  TORCH_CHECK(I == 0 || (N == 2 * I && I % 16 == 0), "quant_pack: interleave I needs N = 2 I and 16 | I");
  const int64_t NB = I ? I / 16 : (N + 31) / 32;
  auto out = torch::zeros({NB, KB, T}, blocks.options());
  const uint8_t* src = bl.data_ptr<uint8_t>();
  const uint16_t* wv = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint8_t* o = out.data_ptr<uint8_t>();
  // column n of half h of block nb (past N: zero scales, zero weights)
  auto column = [&](int64_t nb, int h, int n) { return I ? h * I + nb * 16 + n : nb * 32 + h * 16 + n; };
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint8_t* t = o + (nb * KB + kb) * T;
        for (int h = 0; h < 2; ++h)
          for (int n = 0; n < 16; ++n) {
            const int64_t col = column(nb, h, n);
            if (col >= N) continue;
            const uint8_t* blk = src + (col * KB + kb) * G;  // GGUF: d, (m,) then the weights
            std::memcpy(t + L::d_at(h) + 2 * n, blk, 2);
            if constexpr (L::kQ4) std::memcpy(t + L::m_at(h) + 2 * n, blk + 2, 2);
            for (int k = 0; k < 32; ++k) {  // weight k: word 2 n + k % 2 of line k / 2
              uint8_t q;
              if constexpr (L::kQ4)
                q = k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
              else
                q = blk[2 + k];
              t[L::line_at(k / 2, h) + 2 * n + k % 2] |= L::bits(q, h);
            }
          }
      }
  });
  // Every packed weight, read back and rounded as the loader rounds it, against w's bfloat16 bits.
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1 && bad.load(std::memory_order_relaxed) < 0; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint8_t* t = o + (nb * KB + kb) * T;
        for (int h = 0; h < 2; ++h)
          for (int n = 0; n < 16; ++n) {
            const int64_t col = column(nb, h, n);
            uint16_t dh, mh;
            std::memcpy(&dh, t + L::d_at(h) + 2 * n, 2);
            if constexpr (L::kQ4) std::memcpy(&mh, t + L::m_at(h) + 2 * n, 2);
            for (int k = 0; k < 32; ++k) {
              float v = _cvtsh_ss(dh) * static_cast<float>(L::q(t, k / 2, h, 2 * n + k % 2));  // exact in float32
              if constexpr (L::kQ4) v += _cvtsh_ss(mh);
              const uint16_t got = c10::BFloat16(v).x;  // round to nearest even
              const int64_t at = col * 32 * KB + 32 * kb + k;
              if (col < N ? got != wv[at] : got != 0) {
                int64_t none = -1;
                bad.compare_exchange_strong(none, col < N ? at : 0);
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
