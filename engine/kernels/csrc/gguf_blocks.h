// The decode linears on a GGUF checkpoint's own blocks (Q4_1, Q8_0): each weight read as stored
// (5 or 8.5 bits instead of bfloat16's 16) and multiplied as the checkpoint defines it, in integers.
//
// Per 32-input block of a column, sum_k x_k w_k = d sum_k q_k x_k + m sum_k x_k (Q4_1: w = d q + m,
// q a nibble; Q8_0: w = d q, q an int8, m = 0). x's block (bfloat16) is written as s v_k with s =
// max_k |x_k| / 32512 and v_k = round(x_k / s), a 16-bit integer, split v = 256 hi + lo into two
// signed bytes (quantize_x); `vpdpbusd` (AVX512-VNNI) multiplies 64 unsigned weight bytes by 64
// signed activation bytes and sums each 4 into a 32-bit lane, so per block and column
//   Q4_1: y += d s (256 A_hi + A_lo) + m sx                    (A = sum_k q_k hi_k, sum_k q_k lo_k)
//   Q8_0: y += d s (256 A_hi + A_lo - 128 sv)                  (the bytes stored as u = q + 128)
// with sx the block's float32 sum of x and sv = sum_k v_k. The integer sums are exact (< 2^24 for
// Q4_1, < 2^31 for Q8_0); the one rounding beyond float32's is x's to 16 bits: at most half a step
// s / 2, 2^-16 of the block's largest |x| (bfloat16 itself holds 2^-9 of each value), far below the
// output's bfloat16 rounding; a block holding an inf or a NaN gives NaN. tests/test_gguf_blocks.py
// holds both kinds against float64 with that bound. Against the same products on bfloat16 words
// and `vdpbf16ps` (this kernel before 2026-12-06: 32 products a 0.9 ns instruction, four ops to
// widen 64 weights), a Q4_1 tile takes 13-16 against 29-36 ns on one Sapphire Rapids core: the
// weights are no longer widened past bytes, and an instruction takes 64 products.
//
// Packed layout (quant_pack), per 32-column block nb and 32-input block kb (kb = the GGUF block of
// every column), two halves h of 16 columns (columns 32 nb + 16 h .. + 16, or with interleave I
// the gate columns 16 nb .. + 16 (h = 0) and the same up columns (h = 1)). A "line" is 64 bytes
// for inputs 4 g .. 4 g + 3 (g = 0..7): byte 4 n + j for column n of a half and input 4 g + j, so
// `vpdpbusd` sums column n in 32-bit lane n.
//   Q4_1 (640 bytes): d[h=0] 16 x fp16 (column order), m[h=0], d[h=1], m[h=1]; then per g one line:
//        half 0's nibble low, half 1's high.
//   Q8_0 (1088 bytes): d[h=0], d[h=1] 16 x fp16; then per g and h one line of q + 128 (unsigned).
// quant_pack checks every packed weight, rounded as the loader rounds it (bf16(float(d) q +
// float(m))), against the loaded bfloat16 weight: a pack is only made of the very blocks loaded.
#pragma once
#include "kernel_header.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace servelab {

enum class BlockKind : int { Q4_1 = 0, Q8_0 = 1 };

// GGUF block sizes (bytes per 32 weights); a packed tile's size (32 columns x 32 inputs) -> its kind.
static inline int64_t gguf_block_bytes(BlockKind k) { return k == BlockKind::Q4_1 ? 20 : 34; }
static inline int packed_kind(int64_t tile_bytes) { return tile_bytes == 640 ? 0 : tile_bytes == 1088 ? 1 : -1; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
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

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SERVELAB_GGUF_BLOCKS 1

template <BlockKind K>
struct TileLayout {
  static constexpr bool kQ4 = K == BlockKind::Q4_1;
  static constexpr int64_t kBytes = kQ4 ? 640 : 1088;
  static constexpr int64_t kHead = kQ4 ? 128 : 64;  // the scales
  // Byte offsets in a tile: half h's d and m (Q4_1) scales (16 x fp16 each, column order), and the
  // line of inputs 4 g .. 4 g + 3 (Q4_1: both halves' nibbles; Q8_0: half h's bytes).
  static constexpr int64_t d_at(int h) { return h * (kHead / 2); }
  static constexpr int64_t m_at(int h) { return h * 64 + 32; }
  static constexpr int64_t line_at(int g, int h) { return kQ4 ? kHead + g * 64 : kHead + (2 * g + h) * 64; }
  // The weight of column n of half h at input k, as the integer the scales multiply; and the bits a
  // stored byte holds for integer q (Q4_1: OR-ed with the other half's nibble).
  static int q(const uint8_t* t, int k, int h, int n) {
    const uint8_t byte = t[line_at(k / 4, h) + 4 * n + k % 4];
    if constexpr (kQ4) return h == 0 ? byte & 15 : byte >> 4;
    return static_cast<int>(byte) - 128;
  }
  static uint8_t bits(int q, int h) {
    if constexpr (kQ4) return static_cast<uint8_t>(h == 1 ? q << 4 : q);
    return static_cast<uint8_t>(q + 128);
  }
};

// x [M, K] (bfloat16) as the products read it: per row and 32-input block, the signed bytes hi
// and lo of v = round(x / s) = 256 hi + lo, four to a 32-bit word (inputs 4 g .. 4 g + 3: what
// vpdpbusd broadcasts; [M, K / 4] each), s (float [M, K / 32]; NaN for a block holding an inf or
// a NaN), the float32 sum of x and sv = sum v (int32).
struct QuantX {
  static constexpr float kSteps = 32512.f;  // |v| <= 32512: hi = (v + 128) >> 8 stays in [-127, 127]
  int64_t K = 0, KB = 0;
  std::vector<int32_t> hi, lo;
  std::vector<float> scale, sum;
  std::vector<int32_t> vsum;
  const int32_t* hi_words(int64_t row) const { return hi.data() + row * (K / 4); }
  const int32_t* lo_words(int64_t row) const { return lo.data() + row * (K / 4); }
};

static inline __m512 bf16_floats(__m256i v) {  // 16 bfloat16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Fills q (its vectors keep their capacity from call to call: a caller's thread_local QuantX
// saves a decode step's ~120 linears five allocations each).
static inline void quantize_x(QuantX& q, const bf16* x, int64_t M, int64_t K) {
  q.K = K;
  q.KB = K / 32;
  q.hi.resize(M * K / 4);
  q.lo.resize(M * K / 4);
  q.scale.resize(M * q.KB);
  q.sum.resize(M * q.KB);
  q.vsum.resize(M * q.KB);
  const __m512i round_up = _mm512_set1_epi32(128);
  for (int64_t b = 0; b < M * q.KB; ++b) {
    const bf16* xb = x + b * 32;
    const __m512 x0 = bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
    const __m512 x1 = bf16_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const bool finite = std::isfinite(amax);  // false for a NaN too (max may drop it: checked below)
    const bool nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
    const float inv = finite && amax > 0.f ? QuantX::kSteps / amax : 0.f;
    __m512i v[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv))),
                    _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)))};  // round to nearest even
    if (!finite || nan) v[0] = v[1] = _mm512_setzero_si512();
    for (int i = 0; i < 2; ++i) {
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(v[i], round_up), 8);
      const __m512i l = _mm512_sub_epi32(v[i], _mm512_slli_epi32(h, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.hi.data() + b * 8 + 4 * i), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.lo.data() + b * 8 + 4 * i), _mm512_cvtepi32_epi8(l));
    }
    q.scale[b] = finite && !nan ? amax / QuantX::kSteps : std::numeric_limits<float>::quiet_NaN();
    q.sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    q.vsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(v[0], v[1]));
  }
}

// Each tile asks for the lines kQuantPrefetch bytes further on in this thread's stream (its blocks
// are contiguous; a step's ~96 MB come from the last-level cache at best, and the hardware's
// prefetcher alone left SmolLM2's batch-1 step at 13-16 GB/s against `torch.sum`'s 25 from memory,
// a Q8_0 LM head of 30 MB in 2.3 ms). How far ahead follows the products' speed: 2,048 bytes
// suited the bfloat16-word kernel (10.1 -> 7.2 ms a token, with the packs on huge pages:
// forward_plan.on_huge_pages); with the integer products, 2 threads, alternating builds in one
// window: 8,192 bytes 3.28-3.48 ms, 4,096 3.72-3.95, 16,384 3.41-3.69, 2,048 5.2-5.3
// (docs/benchmarks-log.md, 2026-12-06). On a Zen 4 prefetching the next block measured no faster.
constexpr int64_t kQuantPrefetch = 8192;  // bytes ahead in a thread's stream (quant_rows)

// R rows of x (quantize_x's, from row j0; row jc on in cf) against one 32-column block of KB
// tiles: per tile the integer sums A_hi, A_lo per row and half in registers (two interleaved
// chains of each at 1-2 rows: one chain is vpdpbusd's latency, not its throughput), then folded
// into float32 accumulators as the header says. Row j lands where the AMX tiles would store it (c[j / 16][h],
// row j % 16), as dp_rows puts it.
template <BlockKind K, int R>
static inline void quant_rows(const QuantX& xq, int64_t j0, int jc, float* cf, const uint8_t* wb) {
  using L = TileLayout<K>;
  constexpr bool q4 = L::kQ4;
  constexpr int S = R <= 2 ? 2 : 1;  // chains per row, half and part
  const int64_t KB = xq.KB;
  const int32_t* hi[R];
  const int32_t* lo[R];
  for (int r = 0; r < R; ++r) {
    hi[r] = xq.hi_words(j0 + r);
    lo[r] = xq.lo_words(j0 + r);
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* t = wb + kb * L::kBytes;
    for (int64_t off = 0; off < L::kBytes; off += 64)  // this thread's stream, kQuantPrefetch bytes on
      _mm_prefetch(reinterpret_cast<const char*>(t + kQuantPrefetch + off), _MM_HINT_T0);
    __m512i H[S][R][2], Lo[S][R][2];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) H[s][r][0] = H[s][r][1] = Lo[s][r][0] = Lo[s][r][1] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += S)
      for (int s = 0; s < S; ++s) {
        __m512i w[2];
        if constexpr (q4) {
          const __m512i v = _mm512_loadu_si512(t + L::line_at(g + s, 0));
          w[0] = _mm512_and_si512(v, nibble);  // half 0: the low nibbles
          w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        } else {
          for (int h = 0; h < 2; ++h) w[h] = _mm512_loadu_si512(t + L::line_at(g + s, h));
        }
        for (int r = 0; r < R; ++r) {
          const __m512i bh = _mm512_set1_epi32(hi[r][kb * 8 + g + s]);
          const __m512i bl = _mm512_set1_epi32(lo[r][kb * 8 + g + s]);
          for (int h = 0; h < 2; ++h) {
            H[s][r][h] = _mm512_dpbusd_epi32(H[s][r][h], w[h], bh);
            Lo[s][r][h] = _mm512_dpbusd_epi32(Lo[s][r][h], w[h], bl);
          }
        }
      }
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L::d_at(h))));
      __m512 m = _mm512_setzero_ps();
      if constexpr (q4) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L::m_at(h))));
      for (int r = 0; r < R; ++r) {
        const int64_t b = (j0 + r) * KB + kb;
        __m512i a_hi = H[0][r][h], a_lo = Lo[0][r][h];
        for (int s = 1; s < S; ++s) {
          a_hi = _mm512_add_epi32(a_hi, H[s][r][h]);
          a_lo = _mm512_add_epi32(a_lo, Lo[s][r][h]);
        }
        __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(a_hi, 8), a_lo);  // sum_k q_k v_k (Q8_0: u_k v_k)
        if constexpr (!q4) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xq.vsum[b]));
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(xq.scale[b])), acc[r][h]);
        if constexpr (q4) acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.sum[b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int j = jc + r;
    _mm512_store_ps(cf + ((j / 16) * 2) * 256 + (j % 16) * 16, acc[r][0]);
    _mm512_store_ps(cf + ((j / 16) * 2 + 1) * 256 + (j % 16) * 16, acc[r][1]);
  }
}

template <BlockKind K, int N>
static inline void quant_rows_tail(const QuantX& xq, int64_t j0, int jc, int n, float* cf, const uint8_t* wb) {
  if constexpr (N > 0) {
    if (n == N)
      quant_rows<K, N>(xq, j0, jc, cf, wb);
    else
      quant_rows_tail<K, N - 1>(xq, j0, jc, n, cf, wb);
  }
}

// Rows from 16 mt on (up to 32) in groups of at most 4 (16 integer accumulators and 8 float
// ones at 4 rows), each group reading the block again (from L1 or L2).
template <BlockKind K>
static inline void quantized_block(const QuantX& xq, int64_t M, int64_t mt, const uint8_t* wb, float* cf) {
  constexpr int G = 4;
  const int rows = static_cast<int>(std::min<int64_t>(32, M - mt * 16));
  int j = 0;
  for (; j + G <= rows; j += G) quant_rows<K, G>(xq, mt * 16 + j, j, cf, wb);
  quant_rows_tail<K, G - 1>(xq, mt * 16 + j, j, rows - j, cf, wb);
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
            const uint8_t* blk = col < N ? src + (col * KB + kb) * G : nullptr;  // GGUF: d, (m,) then the weights
            if (blk) {  // past N: zero scales, zero weights
              std::memcpy(t + L::d_at(h) + 2 * n, blk, 2);
              if constexpr (L::kQ4) std::memcpy(t + L::m_at(h) + 2 * n, blk + 2, 2);
            }
            for (int k = 0; k < 32; ++k) {  // weight k: byte 4 n + k % 4 of line k / 4
              int q = 0;
              if (blk && L::kQ4)
                q = k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
              else if (blk)
                q = static_cast<int8_t>(blk[2 + k]);
              t[L::line_at(k / 4, h) + 4 * n + k % 4] |= L::bits(q, h);
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
              float v = _cvtsh_ss(dh) * static_cast<float>(L::q(t, k, h, n));  // exact in float32
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
