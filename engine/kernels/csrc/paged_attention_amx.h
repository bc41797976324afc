// Paged attention's AMX paths (bfloat16): decode rows, and prefill rows as whole query blocks.
#pragma once
#include "amx_tiles.h"
#include "paged_attention_avx512.h"

namespace servelab {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The AMX path (bfloat16, CPUs with AMX): a query row's scores against 16 cached tokens are one
// tile product. The item's part of a kv row (span = hpi * D elements: its kv heads side by side)
// read for 16 tokens is the 16 x span matrix A, as stored (row stride: the cache row); it
// multiplies the block-diagonal span x 16 matrix B whose column jj holds query head jj in the
// rows of its kv head, zero elsewhere: C[token][jj] = q_jj . k_token, bfloat16 products summed
// in float32 (as vdpbf16ps sums them). B is built once per item (span / 32 tiles of 32 x 16 in
// AMX's pair layout) and stays in tile registers where it fits (span <= 192: SmolLM2's 3 x 64).
// Scores are token-major (a token's 16 lanes hold its score for each query head), so the
// softmax runs across heads in vector lanes; the values pass is the AVX-512 path's, in float32.
// Tile loads of cache lines not yet fetched stall the tile unit, so the blocks PF ahead are
// prefetched as in the AVX-512 path (cold-cache decode: benchmarks/cpu_paged_attention.py).
// Tiles as configure_tiles (amx_tiles.h) sets them: 0 = C, 1 = A, 2..7 = B.

// The tile intrinsics take tile numbers as literals (spelled into the instruction), so the
// resident-B products are written out per chunk count: B chunk c lives in tile 2 + c.
#define SL_LOAD_B(c, tile) _tile_loadd(tile, bq + 256 * (c), 64)
#define SL_DOT(c, tile)                       \
  _tile_loadd(1, a + 32 * (c), stride_bytes); \
  _tile_dpbf16ps(0, 1, tile)
template <int CH>
static inline void load_bs(const uint32_t* bq) {
  SL_LOAD_B(0, 2);
  SL_LOAD_B(1, 3);
  if constexpr (CH >= 4) { SL_LOAD_B(2, 4); SL_LOAD_B(3, 5); }
  if constexpr (CH >= 6) { SL_LOAD_B(4, 6); SL_LOAD_B(5, 7); }
}
// 16 tokens' scores (C = A B, stored token-major at s), B resident in tiles 2 .. 1 + CH.
template <int CH>
static inline void scores_resident(const bf16* a, int64_t stride_bytes, float* s) {
  _tile_zero(0);
  SL_DOT(0, 2);
  SL_DOT(1, 3);
  if constexpr (CH >= 4) { SL_DOT(2, 4); SL_DOT(3, 5); }
  if constexpr (CH >= 6) { SL_DOT(4, 6); SL_DOT(5, 7); }
  _tile_stored(0, s, 64);
}
#undef SL_LOAD_B
#undef SL_DOT

// 16 tokens' scores with B streamed from memory (more chunks than free tiles).
static inline void scores_streamed(const bf16* a, int64_t stride_bytes, const uint32_t* bq, int64_t chunks, float* s) {
  _tile_zero(0);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(2, bq + 256 * c, 64);
    _tile_loadd(1, a + 32 * c, stride_bytes);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, s, 64);
}

template <int C>
static void paged_attention_amx(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp,
                                int64_t bts, const int64_t* qslp, const int64_t* slp, int64_t B,
                                float scale, torch::Tensor& out, bool fixed_items = false) {
  constexpr int64_t D = 16 * C;
  constexpr int64_t PF = 2;  // cache blocks prefetched ahead of the one being read (as tuned on AMX)
  const PagedView<bf16> v(q, kv_cache, qslp, B, out);
  const int64_t Tn = v.Tn, Hq = v.Hq, BS = v.BS, Hkv = v.Hkv, G = v.G, row = v.row;
  const int64_t qs0 = v.qs0, qs1 = v.qs1;
  const bf16 *qp = v.qp, *kp = v.kp, *vp = v.vp;
  bf16* op = v.op;
  const std::vector<int64_t>& req_of = v.req_of;
  // Work items as in the AVX-512 path (the caller checks that an item has at most 16 query heads).
  const int64_t hpi = heads_per_item(Tn, Hkv, fixed_items);
  const int64_t parts = Hkv / hpi, nh = hpi * G, span = hpi * D, chunks = span / 32;
  const int64_t stride_bytes = row * static_cast<int64_t>(sizeof(bf16));
  const int64_t pf_bytes = span * static_cast<int64_t>(sizeof(bf16));
  at::parallel_for(0, Tn * parts, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<float> scores, acc(nh * D);
    std::vector<uint32_t> bq(chunks * 256);
    alignas(64) float inv[16];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / parts, h0 = (w % parts) * hpi;
      const int64_t b = req_of[i];
      const int64_t q_len = qslp[b + 1] - qslp[b];
      const int64_t L = slp[b] - q_len + (i - qslp[b]) + 1;  // positions attended: 0 .. L - 1
      const int64_t nb = (L + BS - 1) / BS;
      const int64_t* blocks = btp + b * bts;
      const bf16* qrow = qp + i * qs0 + h0 * G * qs1;  // query head jj of this item: qrow + jj * qs1
      auto kblock = [&](int64_t bi) { return kp + blocks[bi] * BS * row + h0 * D; };
      auto vblock = [&](int64_t bi) { return vp + blocks[bi] * BS * row + h0 * D; };
      for (int64_t bi = 0; bi < std::min(PF, nb); ++bi) prefetch_rows(kblock(bi), BS, row, pf_bytes);
      // B: chunk c covers elements [32 c, 32 c + 32) of the item's kv row (kv head c / (D / 32));
      // row k2 of its tile holds, for each column jj, the pair (2 k2, 2 k2 + 1) of those elements.
      std::fill(bq.begin(), bq.end(), 0u);
      for (int64_t jj = 0; jj < nh; ++jj) {
        const int64_t hh = jj / G;
        const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qrow + jj * qs1);
        for (int64_t cc = 0; cc < D / 32; ++cc)
          for (int64_t k2 = 0; k2 < 16; ++k2) bq[(hh * (D / 32) + cc) * 256 + k2 * 16 + jj] = q32[cc * 16 + k2];
      }
      if (chunks == 6) load_bs<6>(bq.data());
      else if (chunks == 4) load_bs<4>(bq.data());
      else if (chunks == 2) load_bs<2>(bq.data());
      // Scores of whole 16-token tiles: rows past L are the block's other slots (allocated, unread
      // below: the softmax and the values stop at L).
      scores.resize(nb * BS * 16);
      float* s = scores.data();
      for (int64_t bi = 0; bi < nb; ++bi) {
        const bf16* kb = kblock(bi);
        if (bi + PF < nb) prefetch_rows(kblock(bi + PF), BS, row, pf_bytes);
        else if (bi + PF == nb) prefetch_rows(vblock(0), BS, row, pf_bytes);
        for (int64_t o0 = 0; o0 < BS && bi * BS + o0 < L; o0 += 16) {
          const bf16* a = kb + o0 * row;
          float* sb = s + (bi * BS + o0) * 16;
          if (chunks == 6) scores_resident<6>(a, stride_bytes, sb);
          else if (chunks == 4) scores_resident<4>(a, stride_bytes, sb);
          else if (chunks == 2) scores_resident<2>(a, stride_bytes, sb);
          else scores_streamed(a, stride_bytes, bq.data(), chunks, sb);
        }
      }
      // Softmax over tokens, the query heads side by side in the lanes: exp(scale (x - max x)).
      const __m512 vscale = _mm512_set1_ps(scale);
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < L; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t * 16));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const __m512 e = vexp(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t * 16), mx), vscale));
        _mm512_storeu_ps(s + t * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t bi = 1; bi < std::min(PF, nb); ++bi) prefetch_rows(vblock(bi), BS, row, pf_bytes);
      for (int64_t t0 = 0, bi = 0; t0 < L; t0 += BS, ++bi) {
        if (bi + PF < nb) prefetch_rows(vblock(bi + PF), BS, row, pf_bytes);
        values_heads<bf16, C>(vblock(bi), std::min(BS, L - t0), row, hpi, G, s + t0 * 16, 1, 16, acc.data());
      }
      for (int64_t jj = 0; jj < nh; ++jj) {
        bf16* oj = op + (i * Hq + h0 * G + jj) * D;
        const __m512 r = _mm512_set1_ps(inv[jj]);
        for (int c = 0; c < C; ++c) vst(oj + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + jj * D + 16 * c), r));
      }
    }
    _tile_release();
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Prefill rows on AMX (bfloat16): attention of whole query blocks as tile products, reading keys
// and values from the paged cache (this step's are already written), for fresh prefills and
// prefills over a cached context alike. Per request and kv head, the context is first laid out
// once for the tile unit: keys transposed into B's pair layout (KT[c][k2][t] = the pair k2 of
// chunk c of key t, as 32 bits) and values as pairs of consecutive tokens (VV[t / 2][d] = v[t][d],
// v[t + 1][d]). Then per query block (16 query rows of one query head): S = Q K^T in 16 x 16
// tiles, the causal mask (query row r sits at position ctx + r), an exact softmax per row (max
// over the row, exp, sum, in float32), O = P V in 16 x 16 tiles summed in float32, O / sum rounded
// once on the store. The tile unit multiplies bfloat16 only: P goes in as two bfloat16 terms, its
// rounded value and the rounded remainder (16 significant bits, against 8 for P rounded once), so
// O keeps float32-like probabilities for one more cheap tile product per value tile.
struct PrefillRequest {
  int64_t b, q0, q_len, ctx, S, S16, S32, buf;  // buf: offset of its KT / VV buffers (uint32 words)
};

template <int C>
static void prefill_attention_amx(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp,
                                  int64_t bts, const int64_t* qstart, const int64_t* qlen, const int64_t* slp,
                                  int64_t B, float scale, torch::Tensor& out) {
  constexpr int64_t D = 16 * C, DC = D / 32;  // DC: 32-element chunks of a head (2 or 4)
  static_assert(DC + 2 <= 8, "tiles: S, the query chunks, one B");
  const int64_t Hq = q.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3), G = Hq / Hkv;
  const int64_t row = Hkv * D, qs0 = q.stride(0), qs1 = q.stride(1);
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = kv_cache.data_ptr<bf16>();
  const bf16* vp = kp + kv_cache.size(1) * BS * row;
  bf16* op = out.data_ptr<bf16>();
  std::vector<PrefillRequest> reqs;
  int64_t words = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qlen[b];
    if (q_len == 0) continue;
    const int64_t S = slp[b], S16 = (S + 15) / 16 * 16, S32 = (S + 31) / 32 * 32;
    reqs.push_back({b, qstart[b], q_len, S - q_len, S, S16, S32, words});
    words += Hkv * (D / 2 * S16 + S32 / 2 * D);  // KT then VV, per kv head
  }
  std::vector<uint32_t> buf(words);
  // 1. Context layouts, one item per (request, kv head).
  at::parallel_for(0, static_cast<int64_t>(reqs.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const PrefillRequest& r = reqs[w / Hkv];
      const int64_t h = w % Hkv;
      uint32_t* kt = buf.data() + r.buf + h * (D / 2 * r.S16 + r.S32 / 2 * D);
      uint32_t* vv = kt + D / 2 * r.S16;
      const int64_t* blocks = btp + r.b * bts;
      for (int64_t t = 0; t < r.S16; ++t) {
        if (t >= r.S) {
          for (int64_t k2 = 0; k2 < D / 2; ++k2) kt[k2 * r.S16 + t] = 0u;
          continue;
        }
        const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kp + (blocks[t / BS] * BS + t % BS) * row + h * D);
        for (int64_t k2 = 0; k2 < D / 2; ++k2) kt[k2 * r.S16 + t] = k32[k2];
      }
      const uint16_t* zero = nullptr;
      for (int64_t t = 0; t < r.S32; t += 2) {
        const uint16_t* v0 = t < r.S ? reinterpret_cast<const uint16_t*>(vp + (blocks[t / BS] * BS + t % BS) * row + h * D) : zero;
        const uint16_t* v1 = t + 1 < r.S ? reinterpret_cast<const uint16_t*>(vp + (blocks[(t + 1) / BS] * BS + (t + 1) % BS) * row + h * D) : zero;
        uint32_t* dst = vv + t / 2 * D;
        for (int64_t d = 0; d < D; ++d)
          dst[d] = (v0 ? v0[d] : 0u) | (static_cast<uint32_t>(v1 ? v1[d] : 0u) << 16);
      }
    }
  });
  // 2. Query blocks, one item per (request, query head, 16 query rows).
  std::vector<int64_t> item_start(reqs.size() + 1, 0);
  for (size_t i = 0; i < reqs.size(); ++i) item_start[i + 1] = item_start[i] + (reqs[i].q_len + 15) / 16 * Hq;
  at::parallel_for(0, item_start.back(), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<float> sbuf;
    std::vector<bf16> pbuf;
    alignas(64) float obuf[16 * D];
    alignas(64) bf16 qpad[16 * D];
    float inv[16];
    size_t ri = std::upper_bound(item_start.begin(), item_start.end(), begin) - item_start.begin() - 1;
    for (int64_t w = begin; w < end; ++w) {
      while (w >= item_start[ri + 1]) ++ri;
      const PrefillRequest& r = reqs[ri];
      const int64_t local = w - item_start[ri], j = local % Hq, qb = local / Hq, h = j / G;
      const int64_t r0 = qb * 16, nr = std::min<int64_t>(16, r.q_len - r0);
      const uint32_t* kt = buf.data() + r.buf + h * (D / 2 * r.S16 + r.S32 / 2 * D);
      const uint32_t* vv = kt + D / 2 * r.S16;
      // Query rows: in place (row stride qs0) when 16 rows exist, else a zero-padded copy.
      const bf16* qa = qp + (r.q0 + r0) * qs0 + j * qs1;
      int64_t qstride = qs0 * static_cast<int64_t>(sizeof(bf16));
      if (nr < 16) {
        std::memset(qpad, 0, sizeof(qpad));
        for (int64_t rr = 0; rr < nr; ++rr) std::memcpy(qpad + rr * D, qa + rr * qs0, D * sizeof(bf16));
        qa = qpad;
        qstride = D * static_cast<int64_t>(sizeof(bf16));
      }
      const int64_t tmax = r.ctx + r0 + nr;  // positions attended by the block's last row: 0 .. tmax - 1
      const int64_t nt = (tmax + 15) / 16, n32 = (tmax + 31) / 32;
      const int64_t sw = nt * 16, pw = n32 * 32;  // row widths of the score and probability buffers
      sbuf.resize(16 * sw);
      pbuf.resize(2 * 16 * pw);  // P's bfloat16 value, then its remainder (P - value, as bfloat16)
      _tile_loadd(1, qa, qstride);
      _tile_loadd(2, qa + 32, qstride);
      if constexpr (DC == 4) {
        _tile_loadd(3, qa + 64, qstride);
        _tile_loadd(4, qa + 96, qstride);
      }
      const int64_t kstride = r.S16 * static_cast<int64_t>(sizeof(uint32_t));
      for (int64_t tb = 0; tb < nt; ++tb) {
        _tile_zero(0);
        _tile_loadd(5, kt + 0 * 16 * r.S16 + tb * 16, kstride);
        _tile_dpbf16ps(0, 1, 5);
        _tile_loadd(5, kt + 1 * 16 * r.S16 + tb * 16, kstride);
        _tile_dpbf16ps(0, 2, 5);
        if constexpr (DC == 4) {
          _tile_loadd(5, kt + 2 * 16 * r.S16 + tb * 16, kstride);
          _tile_dpbf16ps(0, 3, 5);
          _tile_loadd(5, kt + 3 * 16 * r.S16 + tb * 16, kstride);
          _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, sbuf.data() + tb * 16, sw * static_cast<int64_t>(sizeof(float)));
      }
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t rr = 0; rr < 16; ++rr) {
        bf16* prow = pbuf.data() + rr * pw;
        bf16* plow = prow + 16 * pw;
        if (rr >= nr) {  // padding rows: zero probabilities (their output is not stored)
          std::memset(prow, 0, pw * sizeof(bf16));
          std::memset(plow, 0, pw * sizeof(bf16));
          continue;
        }
        const int64_t L = r.ctx + r0 + rr + 1;  // this row attends to positions 0 .. L - 1
        float* srow = sbuf.data() + rr * sw;
        __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < L; t += 16)
          mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail_mask(L - t), srow + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < pw; t += 16) {
          const __mmask16 k = t < L ? tail_mask(L - t) : static_cast<__mmask16>(0);
          const __m512 e = _mm512_maskz_mov_ps(k, vexp(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, srow + t), m), vscale)));
          sum = _mm512_add_ps(sum, e);
          const __m256bh hi = _mm512_cvtneps_pbh(e);
          const __m512 rest = _mm512_sub_ps(e, _mm512_cvtpbh_ps(hi));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + t), (__m256i)hi);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(plow + t), (__m256i)_mm512_cvtneps_pbh(rest));
        }
        inv[rr] = 1.f / _mm512_reduce_add_ps(sum);
      }
      // O = P V: four 16-column tiles of O at a time (tiles 0-3), P in tile 4, V in tile 5.
      const int64_t pstride = pw * static_cast<int64_t>(sizeof(bf16)), vstride = D * static_cast<int64_t>(sizeof(uint32_t));
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t t0 = 0; t0 < n32 * 32; t0 += 32) {
          _tile_loadd(4, pbuf.data() + t0, pstride);
          _tile_loadd(6, pbuf.data() + 16 * pw + t0, pstride);
          const uint32_t* vb = vv + t0 / 2 * D + d0;
          _tile_loadd(5, vb, vstride);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(0, 6, 5);
          _tile_loadd(5, vb + 16, vstride);
          _tile_dpbf16ps(1, 4, 5);
          _tile_dpbf16ps(1, 6, 5);
          _tile_loadd(5, vb + 32, vstride);
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(2, 6, 5);
          _tile_loadd(5, vb + 48, vstride);
          _tile_dpbf16ps(3, 4, 5);
          _tile_dpbf16ps(3, 6, 5);
        }
        const int64_t ostride = D * static_cast<int64_t>(sizeof(float));
        _tile_stored(0, obuf + d0, ostride);
        _tile_stored(1, obuf + d0 + 16, ostride);
        _tile_stored(2, obuf + d0 + 32, ostride);
        _tile_stored(3, obuf + d0 + 48, ostride);
      }
      for (int64_t rr = 0; rr < nr; ++rr) {
        bf16* orow = op + ((r.q0 + r0 + rr) * Hq + j) * D;
        const __m512 vr = _mm512_set1_ps(inv[rr]);
        for (int c = 0; c < C; ++c) vst(orow + 16 * c, _mm512_mul_ps(_mm512_load_ps(obuf + rr * D + 16 * c), vr));
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace servelab
