// The decode linears' loops over a packed weight (amx_linear.cpp's ops and planned_layers.cpp's
// team step): x's row tiles, one 32-column block's products (AMX tiles, AVX512-BF16 pairs or the
// GGUF blocks in integers), the blocks split over the threads (team.h), and what each linear stores.
#pragma once
#include "kernel_header.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>
#include "amx_tiles.h"
#include "gguf_blocks.h"
#include "team.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SERVELAB_LINEAR_AMX 1
#elif defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SERVELAB_LINEAR_DPBF16 1
#endif
#if defined(SERVELAB_LINEAR_AMX) || defined(SERVELAB_LINEAR_DPBF16)
#define SERVELAB_LINEAR_ANY 1
#endif

namespace servelab {

#if defined(SERVELAB_LINEAR_AMX)
// a thread's tiles: 0 = C, the rest as each kernel loads them (amx_tiles.h)
static inline void begin_linear_thread() { configure_tiles(); }
static inline void end_linear_thread() { _tile_release(); }
#elif defined(SERVELAB_LINEAR_DPBF16)
static inline bool amx_tiles_granted() { return true; }  // no tile state to ask for
static inline void begin_linear_thread() {}
static inline void end_linear_thread() {}
#endif

#if defined(SERVELAB_LINEAR_ANY)
#if defined(SERVELAB_LINEAR_AMX)
constexpr bool kPadTiles = true;
#else
constexpr bool kPadTiles = false;
#endif
// x's 16-row tiles: in place, the last one (M % 16 rows) as a zero-padded copy.
struct RowTiles {
  const bf16* x;
  int64_t M, K, MT, tail;
  std::vector<bf16> padded;
  // pad: copy the last tile (only AMX's tile loads read whole tiles; the other paths read rows)
  RowTiles(const bf16* x_, int64_t M_, int64_t K_, bool pad = kPadTiles)
      : x(x_), M(M_), K(K_), MT((M_ + 15) / 16), tail(M_ % 16) {
    if (tail && pad) {
      padded.assign(16 * K, bf16(0.f));
      std::memcpy(padded.data(), x + (M - tail) * K, tail * K * sizeof(bf16));
    }
  }
  const bf16* tile(int64_t mt) const { return tail && mt == MT - 1 ? padded.data() : x + mt * 16 * K; }
  int64_t rows(int64_t mt) const { return std::min<int64_t>(16, M - mt * 16); }
};

// One 32-column block for two 16-row tiles of x: c[t][h] (t: row tile, h: column half) holds
// the 16 x 16 float32 results, stored row-major. B's two tiles per step are 2 KiB, read in order.
#if defined(SERVELAB_LINEAR_AMX)
static inline void block_product(const RowTiles& rt, int64_t mt, const uint32_t* wb, int64_t KC, float (*c)[2][256],
                                 const uint32_t* /*next: the tile loads' own prefetching serves*/ = nullptr) {
  const bool two = mt + 1 < rt.MT;
  const bf16* a0 = rt.tile(mt);
  const int64_t sx = rt.K * static_cast<int64_t>(sizeof(bf16));
  _tile_zero(0);
  _tile_zero(1);
  if (!two) {  // one row tile (small batches): half the tile products
    for (int64_t kc = 0; kc < KC; ++kc) {
      _tile_loadd(6, wb + kc * 512, 64);
      _tile_loadd(7, wb + kc * 512 + 256, 64);
      _tile_loadd(4, a0 + kc * 32, sx);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c[0][0], 64);
    _tile_stored(1, c[0][1], 64);
    return;
  }
  const bf16* a1 = rt.tile(mt + 1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < KC; ++kc) {
    _tile_loadd(6, wb + kc * 512, 64);
    _tile_loadd(7, wb + kc * 512 + 256, 64);
    _tile_loadd(4, a0 + kc * 32, sx);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + kc * 32, sx);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c[0][0], 64);
  _tile_stored(1, c[0][1], 64);
  _tile_stored(2, c[1][0], 64);
  _tile_stored(3, c[1][1], 64);
}
#else
// Without AMX (AVX512-BF16: vdpbf16ps): dp_rows (gguf_blocks.h) over the packed block, whose
// 64-byte lines each hold one pair of inputs for 16 columns: each step loads the block's two
// column vectors for one pair; pf (the next block, or null) has its matching lines prefetched
// towards L2 meanwhile (the hardware's prefetcher stops at 4 KiB pages).
struct PackedBlock {
  const uint32_t *wb, *pf;
  struct Step {
    const uint32_t *wk, *pk;
    void pairs(int k2, __m512bh& w0, __m512bh& w1) const {
      w0 = (__m512bh)_mm512_loadu_si512(wk + k2 * 16);
      w1 = (__m512bh)_mm512_loadu_si512(wk + 256 + k2 * 16);
      if (pk) {
        _mm_prefetch(reinterpret_cast<const char*>(pk + k2 * 16), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(pk + 256 + k2 * 16), _MM_HINT_T1);
      }
    }
  };
  Step step(int64_t kc) const { return Step{wb + kc * 512, pf ? pf + kc * 512 : nullptr}; }
};

// The rows of x from row 16 mt on (up to 32) in groups of at most 12 (24 accumulators); the first
// group also prefetches the next block (the caller's `next`).
static inline void block_product(const RowTiles& rt, int64_t mt, const uint32_t* wb, int64_t KC, float (*c)[2][256],
                                 const uint32_t* next = nullptr) {
  const int rows = static_cast<int>(std::min<int64_t>(32, rt.M - mt * 16));
  dp_row_groups<12>(reinterpret_cast<const uint32_t*>(rt.x + mt * 16 * rt.K), rt.K / 2, KC, &c[0][0][0], rows,
                    PackedBlock{wb, next}, PackedBlock{wb, nullptr});
}
#endif

// Round to bfloat16 and back (round to nearest even), as storing a result and reading it would.
static inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

// The next op's packed weight (`next`), whose first blocks each thread prefetches while it reads
// its last block of this one: a step's linears run back to back, and without the hand-off every
// call's first block came from memory at latency, not bandwidth (at batch 1 on a Zen 4 the
// 30 layers' small matrices streamed at 15-18 GB/s where one 57 MB matrix read 22). Either
// layout: an amx_pack result (int32 [NB, KC, 2, 16, 16]) or a quant_pack one (uint8 [NB, KB, T]).
struct NextWeight {
  const uint8_t* w = nullptr;
  int64_t NB = 0, block_bytes = 0;
  explicit NextWeight(const std::optional<torch::Tensor>& next) {
    if (next.has_value() && next->defined()) {
      const bool amx = next->scalar_type() == torch::kInt32 && next->dim() == 5;
      const bool gguf = next->scalar_type() == torch::kUInt8 && next->dim() == 3;
      TORCH_CHECK((amx || gguf) && next->is_contiguous() && next->size(0) > 0, "next: an amx_pack or quant_pack result");
      w = static_cast<const uint8_t*>(next->data_ptr());
      NB = next->size(0);
      block_bytes = next->numel() * static_cast<int64_t>(next->element_size()) / NB;
    }
  }
  // Where the calling thread starts in the next op: at::parallel_for(0, NB, 1) gives thread t
  // blocks from t * ceil(NB / threads) on (OpenMP), as for_each_block splits this op.
  const uint8_t* start_of_this_thread() const {
    if (!w) return nullptr;
    const int64_t T = team_threads(), chunk = (NB + T - 1) / T;
    const int64_t first = team_thread() * chunk;
    return first < NB ? w + first * block_bytes : nullptr;
  }
};

// A packed weight as the loops below walk it: NB blocks of 32 columns; block(nb) is where block
// nb starts; product(rt, mt, nb, c, next) fills c with rows 16 mt .. + 32 of block nb (next: the
// block to prefetch meanwhile, or null). kTiles: it runs on AMX's tile unit.
struct Bf16Blocks {
  static constexpr bool kTiles = true;
  const uint32_t* w;
  int64_t NB, KC;
  const uint8_t* block(int64_t nb) const { return reinterpret_cast<const uint8_t*>(w + nb * KC * 512); }
  void product(const RowTiles& rt, int64_t mt, int64_t nb, float (*c)[2][256], const uint8_t* next) const {
    block_product(rt, mt, w + nb * KC * 512, KC, c, reinterpret_cast<const uint32_t*>(next));
  }
};

#if defined(SERVELAB_GGUF_BLOCKS)
template <BlockKind K>
struct GgufBlocks {  // gguf_blocks.h: the checkpoint's own blocks against x in 16-bit integers
  static constexpr bool kTiles = false;
  const uint8_t* w;
  int64_t NB, KB;
  const QuantX* xq;  // x as the products read it (quantize_x)
  const uint8_t* block(int64_t nb) const { return w + nb * KB * TileLayout<K>::kBytes; }
  void product(const RowTiles& rt, int64_t mt, int64_t nb, float (*c)[2][256], const uint8_t* /*next*/) const {
    quantized_block<K>(*xq, rt.M, mt, block(nb), &c[0][0][0]);  // prefetches its own stream: gguf_blocks.h
  }
};
#endif

// Run body(nb, mt, c) for every 32-column block and pair of row tiles, the blocks split over the
// threads in contiguous ranges (each thread streams its part of the weights once, in order).
template <typename W, typename Body>
static void for_each_block(const RowTiles& rt, const W& wt, const Body& body, const NextWeight& next) {
  team_for(0, wt.NB, [&](int64_t b0, int64_t b1) {
    if constexpr (W::kTiles) begin_linear_thread();
    alignas(64) float c[2][2][256];
    const uint8_t* handoff = next.start_of_this_thread();
    for (int64_t nb = b0; nb < b1; ++nb) {
      for (int64_t mt = 0; mt < rt.MT; mt += 2) {
        wt.product(rt, mt, nb, c, mt == 0 ? (nb + 1 < b1 ? wt.block(nb + 1) : handoff) : nullptr);
        body(nb, mt, c);
      }
    }
    if constexpr (W::kTiles) end_linear_thread();
  });
}
#endif

#if defined(SERVELAB_LINEAR_ANY)
// y [M, N] = x W^T rounded to bfloat16.
template <typename W>
static void linear_into(const RowTiles& rt, const W& wt, int64_t N, bf16* yp, const NextWeight& next) {
  for_each_block(rt, wt, [&](int64_t nb, int64_t mt, float (*c)[2][256]) {
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t n0 = nb * 32 + h * 16;
      if (n0 >= N) continue;
      const __mmask16 nm = N - n0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n0)) - 1u);
      for (int64_t t = 0; t < 2 && mt + t < rt.MT; ++t)
        for (int64_t r = 0; r < rt.rows(mt + t); ++r)
          _mm256_mask_storeu_epi16(yp + ((mt + t) * 16 + r) * N + n0, nm,
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c[t][h] + r * 16)));
    }
  }, next);
}

// y [M, I] = silu(gate) * up of the interleaved [gate; up] projection.
template <typename W>
static void silu_mul_into(const RowTiles& rt, const W& wt, int64_t I, bf16* yp, const NextWeight& next) {
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  for_each_block(rt, wt, [&](int64_t nb, int64_t mt, float (*c)[2][256]) {
    for (int64_t t = 0; t < 2 && mt + t < rt.MT; ++t)
      for (int64_t r = 0; r < rt.rows(mt + t); ++r) {
        // As servelab::silu_mul on the bfloat16 projection: gate / (1 + exp(-gate)) * up.
        const __m512 g = round_bf16(_mm512_load_ps(c[t][0] + r * 16));
        const __m512 u = round_bf16(_mm512_load_ps(c[t][1] + r * 16));
        const __m512 den = _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        __m512 sig = _mm512_rcp14_ps(den);
        sig = _mm512_mul_ps(sig, _mm512_fnmadd_ps(den, sig, two));
        vst(yp + ((mt + t) * 16 + r) * I + nb * 16, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
      }
  }, next);
}

// Per column chunk (one contiguous range of blocks a thread) and row: each lane's best logit so
// far and its column (INT32_MAX: none yet). A team shares one (team.h: every thread of it makes
// the same call, and the chunks' results meet in the merge).
struct ArgmaxScratch {
  std::vector<float> best;
  std::vector<int32_t> where;
  int64_t chunks = 0;
};

// out [M] = each row's index of its first maximum logit (rounded to bfloat16): each of
// min(NB, threads) chunks keeps per row and lane its best value and column, then one merge takes
// the maximum, a NaN above everything, the smallest index among equals (so the chunking does not
// change the answer). In a team the scratch is sized on one thread and the merge runs on one.
template <typename W>
static void argmax_into(const RowTiles& rt, const W& wt, int64_t N, int64_t* op, ArgmaxScratch& s) {
  const int64_t M = rt.M, NB = wt.NB;
  team_single([&] {
    s.chunks = std::min<int64_t>(NB, team_threads());
    s.best.assign(s.chunks * M * 16, -std::numeric_limits<float>::infinity());
    s.where.assign(s.chunks * M * 16, std::numeric_limits<int32_t>::max());
  });
  const int64_t chunks = s.chunks;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  team_for(0, chunks, [&](int64_t c0, int64_t c1) {
    if constexpr (W::kTiles) begin_linear_thread();
    alignas(64) float c[2][2][256];
    for (int64_t ch = c0; ch < c1; ++ch) {
      float* bv = s.best.data() + ch * M * 16;
      int32_t* bi = s.where.data() + ch * M * 16;
      const int64_t nb_end = NB * (ch + 1) / chunks;
      for (int64_t nb = NB * ch / chunks; nb < nb_end; ++nb)
        for (int64_t mt = 0; mt < rt.MT; mt += 2) {
          wt.product(rt, mt, nb, c, mt == 0 && nb + 1 < nb_end ? wt.block(nb + 1) : nullptr);
          for (int64_t h = 0; h < 2; ++h) {
            const int64_t n0 = nb * 32 + h * 16;
            if (n0 >= N) continue;
            const __mmask16 valid = N - n0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n0)) - 1u);
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(n0)));
            for (int64_t t = 0; t < 2 && mt + t < rt.MT; ++t)
              for (int64_t r = 0; r < rt.rows(mt + t); ++r) {
                const int64_t row = (mt + t) * 16 + r;
                const __m512 v = round_bf16(_mm512_load_ps(c[t][h] + r * 16));
                __m512 b = _mm512_loadu_ps(bv + row * 16);
                const __mmask16 nan_v = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan_b = _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
                const __mmask16 take = valid & (_mm512_cmp_ps_mask(v, b, _CMP_GT_OQ) | (nan_v & static_cast<__mmask16>(~nan_b)) |
                                                 _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(bi + row * 16), _mm512_set1_epi32(std::numeric_limits<int32_t>::max())));
                _mm512_storeu_ps(bv + row * 16, _mm512_mask_mov_ps(b, take, v));
                _mm512_storeu_si512(bi + row * 16, _mm512_mask_mov_epi32(_mm512_loadu_si512(bi + row * 16), take, idx));
              }
          }
        }
    }
    if constexpr (W::kTiles) end_linear_thread();
  });
  team_single([&] {
    for (int64_t row = 0; row < M; ++row) {
      float bvv = 0.f;
      int64_t at = -1;
      for (int64_t ch = 0; ch < chunks; ++ch)
        for (int64_t l = 0; l < 16; ++l) {
          const int32_t i = s.where[(ch * M + row) * 16 + l];
          if (i == std::numeric_limits<int32_t>::max()) continue;  // a lane that saw no column
          const float v = s.best[(ch * M + row) * 16 + l];
          const bool better = at < 0 || (std::isnan(v) ? (!std::isnan(bvv) || i < at)
                                                       : (!std::isnan(bvv) && (v > bvv || (v == bvv && i < at))));
          if (better) {
            bvv = v;
            at = i;
          }
        }
      op[row] = at;
    }
  });
}

#endif

}  // namespace servelab
