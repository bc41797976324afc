// Paged attention's AVX-512 path (decode and prefill rows; float32 or bfloat16).
#pragma once
#include "paged_attention_common.h"

namespace servelab {

#if defined(__AVX512F__)
// The vectorised path (AVX-512, head_dim = 16 * C): one work item per query row and kv-head range
// (see the kernel), so the G query heads that share a kv head read each key / value row once,
// converted to float32 in registers. Scores: C fused multiply-adds per (token, head) and one
// horizontal sum; the weighted sum of values keeps a head's accumulator in C registers per block.
// Decode is memory-bound: whole-row items read each cache block as one contiguous span, and the
// blocks PF ahead are prefetched (cold-cache decode, 30 layers: see benchmarks/cpu_paged_attention.py).
static inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// r[o] = sum of the sixteen lanes of v[o], o < 16: 45 instructions where sixteen horizontal sums take ~130.
static inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the four vectors' partial sums
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Sixteen lanes whose sum is q . k (D = 16 * C). bfloat16 with AVX512-BF16: vdpbf16ps on the stored
// bfloat16 values (exact products, float32 sums); otherwise float32 multiply-adds.
template <typename T, int C>
static inline __m512 dot_partial(const float* qf, const T* qraw, const T* k) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < C / 2; ++c)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qraw + 32 * c), (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return acc;
  }
#endif
  (void)qraw;
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf), vld(k));
  for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 16 * c), vld(k + 16 * c), acc);
  return acc;
}

// One query head's scores against 16 cache rows `row` apart (the first m real, the rest 0): sixteen
// partial-sum vectors, then one transposing sum (hsum16) instead of sixteen reductions. Unrolled
// in straight lines (the full block separately), so the partials stay in registers and the query
// is loaded once: as a runtime-bounded loop it kept them on the stack and ran at a third the speed.
template <typename T, int C>
static inline __m512 scores16(const float* qf, const T* qraw, const T* k, int64_t row, int64_t m) {
  __m512 part[16];
  if (m == 16) {
#pragma GCC unroll 16
    for (int o = 0; o < 16; ++o) part[o] = dot_partial<T, C>(qf, qraw, k + o * row);
  } else {
#pragma GCC unroll 16
    for (int o = 0; o < 16; ++o) part[o] = o < m ? dot_partial<T, C>(qf, qraw, k + o * row) : _mm512_setzero_ps();
  }
  return hsum16(part);
}

// In place: s[0 .. L) -> exp(s - max s); returns 1 / sum (and the max at `max_out` where given).
static inline float softmax_unnormalised(float* s, int64_t L, float* max_out = nullptr) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = ninf;
  for (int64_t t = 0; t < L; t += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, tail_mask(L - t), s + t));
  const float top = _mm512_reduce_max_ps(mv);
  if (max_out) *max_out = top;
  const __m512 m = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = tail_mask(L - t);
    const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Bring a later block's rows of one head (D elements each, `row` apart) towards L1 (T0: the AMX
// path, as tuned there) or into L2 (T1: the AVX-512 path, see its PF).
template <int HINT = _MM_HINT_T0, typename T>
static inline void prefetch_rows(const T* p, int64_t n, int64_t row, int64_t bytes) {
  for (int64_t o = 0; o < n; ++o)
    for (int64_t x = 0; x < bytes; x += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + o * row) + x, static_cast<enum _mm_hint>(HINT));
}

// acc[j] += sum over the block's n tokens of p[j * js + o * os] * v[o] for the NG query heads of one
// kv head (acc[j] = acc + j * 16 * C; head-major probabilities: js = L, os = 1; token-major:
// js = 1, os = 16): each value row is converted to float32 once for all NG heads, whose
// accumulators stay in registers (NG * C of them).
template <typename T, int C, int NG>
static inline void values_block(const T* vb, int64_t n, int64_t row, const float* p, int64_t js, int64_t os,
                                float* acc) {
  __m512 a[NG][C];
  for (int j = 0; j < NG; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm512_loadu_ps(acc + j * 16 * C + 16 * c);
  for (int64_t o = 0; o < n; ++o) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vld(vb + o * row + 16 * c);
    for (int j = 0; j < NG; ++j) {
      const __m512 pb = _mm512_set1_ps(p[j * js + o * os]);
      for (int c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(pb, vv[c], a[j][c]);
    }
  }
  for (int j = 0; j < NG; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * 16 * C + 16 * c, a[j][c]);
}

// The values of one block for all G query heads of each of the item's hpi kv heads.
template <typename T, int C>
static inline void values_heads(const T* vb, int64_t n, int64_t row, int64_t hpi, int64_t G, const float* p,
                                int64_t js, int64_t os, float* acc) {
  constexpr int64_t D = 16 * C;
  for (int64_t hh = 0; hh < hpi; ++hh) {
    const T* vh = vb + hh * D;
    const float* ph = p + hh * G * js;
    float* ah = acc + hh * G * D;
    if (G == 3 && 3 * C <= 12) values_block<T, C, 3>(vh, n, row, ph, js, os, ah);
    else if (G == 2 && 2 * C <= 16) values_block<T, C, 2>(vh, n, row, ph, js, os, ah);
    else if (G == 4 && 4 * C <= 16) values_block<T, C, 4>(vh, n, row, ph, js, os, ah);
    else
      for (int64_t j = 0; j < G; ++j) values_block<T, C, 1>(vh, n, row, ph + j * js, js, os, ah + j * D);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 values by vdpbf16ps, two tokens a step: the rows of tokens o and o + 1 interleaved
// (unpacklo / unpackhi of 16-bit words) hold, per 32-bit lane, the same dimension of both, and
// the probabilities of the pair, rounded to bfloat16 (as flash attention feeds P to its second
// product), are one broadcast word: 2 C / 2 interleaves and NG * C multiply-adds of 32 products
// per pair, where the float32 path widens every value and multiply-adds 16 at a time. acc[j] holds
// head j's D sums in the interleaved order (see `unpermute_pairs`); pw[j * pws + o / 2] is the
// pair word of tokens o, o + 1 (an odd block end pairs its last token with zeros, never with the
// unwritten cache row after it).
template <int C, int NG>
static inline void values_block_pairs(const bf16* vb, int64_t n, int64_t row, const uint32_t* pw, int64_t pws,
                                      float* acc) {
  constexpr int V = C / 2;  // 32 values a vector
  __m512 a[NG][2 * V];
  for (int j = 0; j < NG; ++j)
    for (int c = 0; c < 2 * V; ++c) a[j][c] = _mm512_loadu_ps(acc + j * 16 * C + 16 * c);
  for (int64_t o = 0; o < n; o += 2) {
    __m512i il[2 * V];
    for (int c = 0; c < V; ++c) {
      const __m512i x = _mm512_loadu_si512(vb + o * row + 32 * c);
      const __m512i y = o + 1 < n ? _mm512_loadu_si512(vb + (o + 1) * row + 32 * c) : _mm512_setzero_si512();
      il[2 * c] = _mm512_unpacklo_epi16(x, y);
      il[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int j = 0; j < NG; ++j) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[j * pws + o / 2]));
      for (int c = 0; c < 2 * V; ++c) a[j][c] = _mm512_dpbf16_ps(a[j][c], pb, (__m512bh)il[c]);
    }
  }
  for (int j = 0; j < NG; ++j)
    for (int c = 0; c < 2 * V; ++c) _mm512_storeu_ps(acc + j * 16 * C + 16 * c, a[j][c]);
}

// Sums in the interleaved order -> dimension order: vector 2 c + h, lane 4 l + i holds dimension
// 32 c + 8 l + 4 h + i (unpacklo / unpackhi work within each 128-bit lane).
template <int C>
static inline void unpermute_pairs(const float* in, float* out) {
  for (int c = 0; c < C / 2; ++c)
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 4; ++l)
        for (int i = 0; i < 4; ++i) out[32 * c + 8 * l + 4 * h + i] = in[(2 * c + h) * 16 + 4 * l + i];
}

// The probabilities s[0 .. L) of one head as bfloat16 pair words (round to nearest even), L rounded
// up to even with a zero.
static inline void probability_pairs(const float* s, int64_t L, uint32_t* out) {
  int64_t t = 0;
  for (; t + 32 <= L; t += 32)
    _mm512_storeu_si512(out + t / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t)));
  for (; t < L; t += 2) {
    bf16 lo, hi = bf16(0.f);
    st(&lo, 0, s[t]);
    if (t + 1 < L) st(&hi, 0, s[t + 1]);
    out[t / 2] = static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(lo)) |
                 (static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(hi)) << 16);
  }
}

// values_heads for bfloat16 pairs: the G query heads of each of the item's hpi kv heads.
template <int C>
static inline void values_heads_pairs(const bf16* vb, int64_t n, int64_t row, int64_t hpi, int64_t G,
                                      const uint32_t* pw, int64_t pws, float* acc) {
  constexpr int64_t D = 16 * C;
  for (int64_t hh = 0; hh < hpi; ++hh) {
    const bf16* vh = vb + hh * D;
    const uint32_t* ph = pw + hh * G * pws;
    float* ah = acc + hh * G * D;
    if (G == 3 && 3 * C <= 12) values_block_pairs<C, 3>(vh, n, row, ph, pws, ah);
    else if (G == 2 && 2 * C <= 16) values_block_pairs<C, 2>(vh, n, row, ph, pws, ah);
    else if (G == 4 && 4 * C <= 16) values_block_pairs<C, 4>(vh, n, row, ph, pws, ah);
    else
      for (int64_t j = 0; j < G; ++j) values_block_pairs<C, 1>(vh, n, row, ph + j * pws, pws, ah + j * D);
  }
}
#endif

// How many segments each of `items` work items' context is cut into (module note in the kernel):
// under twice the threads' count of items, enough for two units a thread, each segment at least
// kMinSegmentBlocks blocks of the shortest context among the rows; else 1.
constexpr int64_t kMinSegmentBlocks = 2;
static inline int64_t context_segments(int64_t items, int64_t Tn, const int64_t* qslp, const int64_t* slp,
                                       const std::vector<int64_t>& req_of, int64_t BS) {
  const int64_t threads = team_threads();
  if (items == 0 || items >= 2 * threads) return 1;
  int64_t fewest = std::numeric_limits<int64_t>::max();  // blocks of the shortest row's context
  for (int64_t i = 0; i < Tn; ++i) {
    const int64_t b = req_of[i];
    const int64_t L = slp[b] - (qslp[b + 1] - qslp[b]) + (i - qslp[b]) + 1;
    fewest = std::min(fewest, (L + BS - 1) / BS);
  }
  const int64_t want = (2 * threads + items - 1) / items;
  return std::max<int64_t>(1, std::min(want, fewest / kMinSegmentBlocks));
}

// The S segments' partial results of each item -> its query heads' outputs: with M the largest
// segment max, out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s (acc_s, l_s relative to m_s).
template <typename T>
static void merge_segments(const std::vector<float>& pmax, const std::vector<float>& psum,
                           const std::vector<float>& pacc, int64_t items, int64_t S, int64_t nh, int64_t D,
                           int64_t parts, int64_t heads_per_part, int64_t Hq, T* op) {
  std::vector<float> out(D), wgt(S);
  for (int64_t w = 0; w < items; ++w) {
    const int64_t i = w / parts, first_head = (w % parts) * heads_per_part;
    for (int64_t jj = 0; jj < nh; ++jj) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) M = std::max(M, pmax[(w * S + s) * nh + jj]);
      float l = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        wgt[s] = std::exp(pmax[(w * S + s) * nh + jj] - M);
        l += wgt[s] * psum[(w * S + s) * nh + jj];
      }
      std::fill(out.begin(), out.end(), 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const float* a = pacc.data() + ((w * S + s) * nh + jj) * D;
        for (int64_t d = 0; d < D; ++d) out[d] += wgt[s] * a[d];
      }
      T* oj = op + (i * Hq + first_head + jj) * D;
      const float r = 1.f / l;
      for (int64_t d = 0; d < D; ++d) st(oj, d, out[d] * r);
    }
  }
}

// The segments' partial sums of one call (S > 1), shared by the threads that attend its units.
struct SegmentScratch {
  std::vector<float> max, sum, acc;
  int64_t reserved = 0;  // (unit, query head) pairs `reserve` made room for
  // Room for n (unit, query head) pairs of D outputs each; before a team's region only.
  void reserve(int64_t n, int64_t D) {
    max.resize(n);
    sum.resize(n);
    acc.resize(n * D);
    reserved = n;
  }
};

// scratch: where the segments' partial sums go; null: the calling thread's own (a team shares
// one, team.h: every thread of it makes the same call).
template <typename T, int C>
static void paged_attention_avx512(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp,
                                   int64_t bts, const int64_t* qslp, const int64_t* slp, int64_t B,
                                   float scale, torch::Tensor& out, bool fixed_items = false,
                                   SegmentScratch* scratch = nullptr) {
  constexpr int64_t D = 16 * C;
  // Cache blocks prefetched ahead of the one being read, into L2: on a 2-core AMD EPYC Zen 4, cold
  // decode at SmolLM2's shape (benchmarks/cpu_paged_attention.py --layers 30 --threads 2) took 1.26 ms
  // a layer prefetching 2 blocks into L1, 1.06 without software prefetch, 0.70 with 3-4 blocks into L2
  // (0.79 with 6, 0.92 with 8): L1's few miss buffers fill and stall the loads behind them.
  constexpr int64_t PF = 4;
  const PagedView<T> v(q, kv_cache, qslp, B, out);
  const int64_t Tn = v.Tn, Hq = v.Hq, BS = v.BS, Hkv = v.Hkv, G = v.G, row = v.row;
  const int64_t qs0 = v.qs0, qs1 = v.qs1;
  const T *qp = v.qp, *kp = v.kp, *vp = v.vp;
  T* op = v.op;
  const std::vector<int64_t>& req_of = v.req_of;
  // A work item is a query row and a range of kv heads (heads_per_item): all of them when there
  // are rows enough to keep every thread busy (then each cache block is one contiguous read of
  // BS * Hkv * D elements, which the prefetcher streams), else one kv head each (batch-1 decode).
  const int64_t hpi = heads_per_item(Tn, Hkv, fixed_items);
  const int64_t parts = Hkv / hpi, nh = hpi * G, span = hpi * D;
  // With fewer items than twice the threads (a decode step of a row or two), each item's context
  // is cut into S segments of whole blocks (context_segments) attended as separate units, whose
  // partial softmax sums are merged after: SmolLM2's 3 kv heads at batch 1 are 6 units on 2
  // threads instead of 3 items, one thread taking two.
  const int64_t S = fixed_items ? 1 : context_segments(Tn * parts, Tn, qslp, slp, req_of, BS);
  // S > 1: per unit and query head of its item, the segment's max score, its sum of exp(s - max)
  // and its D unnormalised outputs (dimension order)
  // Scratch kept from call to call (a decode step calls this once a layer; every element a unit
  // reads it has written first): no allocation per call. The workers see the caller's vectors
  // through these references (the name of a thread_local object would be their own).
  static thread_local SegmentScratch callers;
  SegmentScratch& shared = scratch ? *scratch : callers;
  std::vector<float>& part_max = shared.max;
  std::vector<float>& part_sum = shared.sum;
  std::vector<float>& part_acc = shared.acc;
  // A caller that reserved room enough (before its team's region: `reserved` never changes
  // inside it, so every thread decides alike) saves the resize and its barrier.
  if (S > 1 && !(scratch && scratch->reserved >= Tn * parts * S * nh))
    team_single([&] {
      part_max.resize(Tn * parts * S * nh);
      part_sum.resize(part_max.size());
      part_acc.resize(part_max.size() * D);
    });
  team_for(0, Tn * parts * S, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> scores, qf, inv, acc, acc_pairs;
    static thread_local std::vector<uint32_t> pairs;
    qf.resize(nh * D);
    inv.resize(nh);
    acc.resize(nh * D);
    acc_pairs.resize(nh * D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t w = u / S, seg = u % S;
      const int64_t i = w / parts, h0 = (w % parts) * hpi;
      const int64_t b = req_of[i];
      const int64_t q_len = qslp[b + 1] - qslp[b];
      const int64_t L = slp[b] - q_len + (i - qslp[b]) + 1;  // positions attended: 0 .. L - 1
      const int64_t nb_all = (L + BS - 1) / BS;
      // this unit's blocks [b0, b1) and tokens [tb, te): segment seg of S, in whole blocks
      const int64_t b0 = nb_all * seg / S, b1 = nb_all * (seg + 1) / S;
      const int64_t tb = b0 * BS, te = std::min(L, b1 * BS), Ls = te - tb;
      const int64_t* blocks = btp + b * bts + b0;  // block bi of the segment: blocks[bi]
      const int64_t nb = b1 - b0;
      const T* qrow = qp + i * qs0 + h0 * G * qs1;  // query head jj of this item: qrow + jj * qs1
      auto kblock = [&](int64_t bi) { return kp + blocks[bi] * BS * row + h0 * D; };
      auto vblock = [&](int64_t bi) { return vp + blocks[bi] * BS * row + h0 * D; };
      for (int64_t bi = 0; bi < std::min(PF, nb); ++bi) prefetch_rows<_MM_HINT_T1>(kblock(bi), BS, row, span * sizeof(T));
      scores.resize(nh * Ls);
      for (int64_t jj = 0; jj < nh; ++jj)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(qf.data() + jj * D + 16 * c, vld(qrow + jj * qs1 + 16 * c));
      // Scores, block by block (no division per token), sixteen tokens at a time (scores16).
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t t0 = 0, bi = 0; t0 < Ls; t0 += BS, ++bi) {
        const int64_t n = std::min(BS, Ls - t0);
        const T* kb = kblock(bi);
        if (bi + PF < nb) prefetch_rows<_MM_HINT_T1>(kblock(bi + PF), BS, row, span * sizeof(T));
        else if (bi + PF == nb) prefetch_rows<_MM_HINT_T1>(vblock(0), BS, row, span * sizeof(T));
        for (int64_t hh = 0; hh < hpi; ++hh)
          for (int64_t o0 = 0; o0 < n; o0 += 16) {
            const int64_t m = std::min<int64_t>(16, n - o0);
            for (int64_t j = 0; j < G; ++j) {
              const int64_t jj = hh * G + j;
              const __m512 sv = scores16<T, C>(qf.data() + jj * D, qrow + jj * qs1, kb + o0 * row + hh * D, row, m);
              _mm512_mask_storeu_ps(scores.data() + jj * Ls + t0 + o0, tail_mask(m), _mm512_mul_ps(sv, vscale));
            }
          }
      }
      float* pmax = S > 1 ? part_max.data() + u * nh : nullptr;
      for (int64_t jj = 0; jj < nh; ++jj) {
        inv[jj] = softmax_unnormalised(scores.data() + jj * Ls, Ls, pmax ? pmax + jj : nullptr);
      }
      // Weighted sum of values, block by block; a head's accumulator is in C registers while it
      // takes a block's tokens, in `acc` between blocks. bfloat16 on AVX512-BF16 (blocks of an
      // even size): two tokens a step by vdpbf16ps (values_block_pairs).
      bool by_pairs = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) by_pairs = BS % 2 == 0;
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t pws = (Ls + 1) / 2;
#if defined(__AVX512BF16__)
      if (by_pairs) {
        pairs.resize(nh * pws);
        for (int64_t jj = 0; jj < nh; ++jj) probability_pairs(scores.data() + jj * Ls, Ls, pairs.data() + jj * pws);
      }
#endif
      for (int64_t bi = 1; bi < std::min(PF, nb); ++bi) prefetch_rows<_MM_HINT_T1>(vblock(bi), BS, row, span * sizeof(T));
      for (int64_t t0 = 0, bi = 0; t0 < Ls; t0 += BS, ++bi) {
        const int64_t n = std::min(BS, Ls - t0);
        const T* vb = vblock(bi);
        if (bi + PF < nb) prefetch_rows<_MM_HINT_T1>(vblock(bi + PF), BS, row, span * sizeof(T));
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, bf16>) {
          if (by_pairs) {
            values_heads_pairs<C>(vb, n, row, hpi, G, pairs.data() + t0 / 2, pws, acc.data());
            continue;
          }
        }
#endif
        values_heads<T, C>(vb, n, row, hpi, G, scores.data() + t0, Ls, 1, acc.data());
      }
#if defined(__AVX512BF16__)
      if (by_pairs) {
        std::copy(acc.begin(), acc.end(), acc_pairs.begin());
        for (int64_t jj = 0; jj < nh; ++jj) unpermute_pairs<C>(acc_pairs.data() + jj * D, acc.data() + jj * D);
      }
#endif
      if (S > 1) {  // the segment's partial sums, merged below
        for (int64_t jj = 0; jj < nh; ++jj) part_sum[u * nh + jj] = 1.f / inv[jj];
        std::copy(acc.begin(), acc.end(), part_acc.begin() + u * nh * D);
        continue;
      }
      for (int64_t jj = 0; jj < nh; ++jj) {
        T* oj = op + (i * Hq + h0 * G + jj) * D;
        const float* aj = acc.data() + jj * D;
        const float r = inv[jj];
        for (int64_t d = 0; d < D; ++d) st(oj, d, aj[d] * r);
      }
    }
  });
  if (S > 1) team_single([&] { merge_segments(part_max, part_sum, part_acc, Tn * parts, S, nh, D, parts, hpi * G, Hq, op); });
}
#endif

}  // namespace servelab
