"""Attention straight from the paged KV cache on a CPU: one C++ kernel for any query rows
(decode, and prefill over a cached context), float32 or bfloat16. The torch backend uses it
for decode, where it beat gather + SDPA 4.6x in bfloat16 and 1.6x in float32. For prefill rows
SDPA's GEMM-based kernel was faster on the Intel Xeons measured first; in bfloat16 on an AMD
Zen 5 (AVX512-BF16, no AMX) this op's vdpbf16ps path was faster (1.6 vs 3.0 ms for 4 fresh
prompts of 128 tokens), and the backend sends such steps' prefill rows here
(`torch_backend.prefill_on_paged_op`; benchmarks/cpu_paged_attention.py).

    torch.ops.servelab.paged_attention(Tensor q, Tensor kv_cache, Tensor block_table,
                                       Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor

q: [T, Hq, D] (any row / head strides, unit stride within a head); kv_cache: [2, num_blocks,
block_size, Hkv, D] contiguous, q's dtype; block_table: [B, max_blocks] int (request b's blocks);
query_start_loc: [B + 1] int (request b's query rows are q[qsl[b]:qsl[b+1]]); seq_lens: [B] int
(request b's context length, this step's tokens included and already written to the cache).
Query row i of request b sits at position seq_len - q_len + (i - qsl[b]) and attends to
positions 0 .. its own (causal with offset); returns [T, Hq, D] contiguous, q's dtype.

Design: one work item per query row (all Hq heads together), so each key / value row, which
holds all Hkv heads contiguously, is read once per query row in cache order and converted to
float32 once for the G = Hq / Hkv query heads sharing it. Decode is memory-bound: this reads
the context once instead of gather + SDPA's reads. Scores are float32, softmax exact (max-shifted).

Paths, chosen per call: AVX-512 (head_dim 64 or 128; bfloat16 scores by vdpbf16ps where the
CPU has AVX512-BF16, and values two tokens a step by vdpbf16ps with the probabilities rounded to
bfloat16; cache blocks prefetched into L2 four ahead), AMX for bfloat16 where the CPU has it (a query row's scores against 16
cached tokens are one tile product: see the kernel's note; cold-cache decode at SmolLM2's
shape, 30 layers: 0.57 against 0.67 ms per layer on the AVX-512 path), else scalar C++.
`set_amx_attention(False)` (or `SERVELAB_CPU_AMX=0`) keeps bfloat16 on the AVX-512 path.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cpu_extension import load_cpu_ops

_CPP_SOURCE = r"""
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <utility>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace servelab {

// Whether the AMX path may run (where it is built and the CPU has it): on unless SERVELAB_CPU_AMX=0;
// `set_amx_attention` changes it (tests and A/B benchmarks run both paths in one process).
static std::atomic<bool> g_amx_enabled{[] {
  const char* e = std::getenv("SERVELAB_CPU_AMX");
  return !(e && e[0] == '0');
}()};

// Sizes, pointers and the request of each query row: what both paths read from the arguments.
template <typename T>
struct PagedView {
  int64_t Tn, Hq, D, BS, Hkv, G, row, qs0, qs1;
  const T *qp, *kp, *vp;
  T* op;
  std::vector<int64_t> req_of;  // query row -> its request
  PagedView(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* qslp, int64_t B, torch::Tensor& out)
      : Tn(q.size(0)), Hq(q.size(1)), D(q.size(2)), BS(kv_cache.size(2)), Hkv(kv_cache.size(3)), G(Hq / Hkv),
        row(Hkv * D), qs0(q.stride(0)), qs1(q.stride(1)), qp(q.data_ptr<T>()), kp(kv_cache.data_ptr<T>()),
        vp(kp + kv_cache.size(1) * BS * row), op(out.data_ptr<T>()), req_of(Tn) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = qslp[b]; i < qslp[b + 1]; ++i) req_of[i] = b;
  }
};

template <typename T>
static void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp,
                                 int64_t bts, const int64_t* qslp, const int64_t* slp, int64_t B,
                                 float scale, torch::Tensor& out) {
  const PagedView<T> v(q, kv_cache, qslp, B, out);
  const int64_t Tn = v.Tn, Hq = v.Hq, D = v.D, BS = v.BS, Hkv = v.Hkv, G = v.G, row = v.row;
  const int64_t qs0 = v.qs0, qs1 = v.qs1;
  const T *qp = v.qp, *kp = v.kp, *vp = v.vp;
  T* op = v.op;
  const std::vector<int64_t>& req_of = v.req_of;
  at::parallel_for(0, Tn, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(Hq * D), acc(Hq * D), kf(D), mx(Hq), inv(Hq);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = req_of[i];
      const int64_t q_len = qslp[b + 1] - qslp[b];
      const int64_t L = slp[b] - q_len + (i - qslp[b]) + 1;  // positions attended: 0 .. L - 1
      const int64_t* blocks = btp + b * bts;
      scores.resize(Hq * L);
      for (int64_t j = 0; j < Hq; ++j) {
        const T* qj = qp + i * qs0 + j * qs1;
        float* f = qf.data() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) f[d] = ld(qj, d) * scale;
        mx[j] = -std::numeric_limits<float>::infinity();
      }
      for (int64_t t = 0; t < L; ++t) {
        const T* kt = kp + (blocks[t / BS] * BS + t % BS) * row;
        for (int64_t h = 0; h < Hkv; ++h) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) kf[d] = ld(kt + h * D, d);
          for (int64_t j = h * G; j < (h + 1) * G; ++j) {
            const float* f = qf.data() + j * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += f[d] * kf[d];
            scores[j * L + t] = s;
            mx[j] = s > mx[j] ? s : mx[j];
          }
        }
      }
      for (int64_t j = 0; j < Hq; ++j) {
        float* sj = scores.data() + j * L;
        const float m = mx[j];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
          const float e = exp_approx(sj[t] - m);
          sj[t] = e;
          sum += e;
        }
        inv[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vt = vp + (blocks[t / BS] * BS + t % BS) * row;
        for (int64_t h = 0; h < Hkv; ++h) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) kf[d] = ld(vt + h * D, d);
          for (int64_t j = h * G; j < (h + 1) * G; ++j) {
            const float p = scores[j * L + t];
            float* a = acc.data() + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * kf[d];
          }
        }
      }
      T* o = op + i * Hq * D;
      for (int64_t j = 0; j < Hq; ++j) {
        const float* a = acc.data() + j * D;
        const float r = inv[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) st(o + j * D, d, a[d] * r);
      }
    }
  });
}

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

// In place: s[0 .. L) -> exp(s - max s); returns 1 / sum.
static inline float softmax_unnormalised(float* s, int64_t L) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = ninf;
  for (int64_t t = 0; t < L; t += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, tail_mask(L - t), s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
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

template <typename T, int C>
static void paged_attention_avx512(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp,
                                   int64_t bts, const int64_t* qslp, const int64_t* slp, int64_t B,
                                   float scale, torch::Tensor& out) {
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
  // A work item is a query row and a range of kv heads: all of them when there are rows enough
  // to keep every thread busy (then each cache block is one contiguous read of BS * Hkv * D
  // elements, which the prefetcher streams), else one kv head each (batch-1 decode).
  const int64_t hpi = Tn >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t parts = Hkv / hpi, nh = hpi * G, span = hpi * D;
  at::parallel_for(0, Tn * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(nh * D), inv(nh);
    std::vector<float> acc(nh * D), acc_pairs(nh * D);
    std::vector<uint32_t> pairs;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / parts, h0 = (w % parts) * hpi;
      const int64_t b = req_of[i];
      const int64_t q_len = qslp[b + 1] - qslp[b];
      const int64_t L = slp[b] - q_len + (i - qslp[b]) + 1;  // positions attended: 0 .. L - 1
      const int64_t nb = (L + BS - 1) / BS;
      const int64_t* blocks = btp + b * bts;
      const T* qrow = qp + i * qs0 + h0 * G * qs1;  // query head jj of this item: qrow + jj * qs1
      auto kblock = [&](int64_t bi) { return kp + blocks[bi] * BS * row + h0 * D; };
      auto vblock = [&](int64_t bi) { return vp + blocks[bi] * BS * row + h0 * D; };
      for (int64_t bi = 0; bi < std::min(PF, nb); ++bi) prefetch_rows<_MM_HINT_T1>(kblock(bi), BS, row, span * sizeof(T));
      scores.resize(nh * L);
      for (int64_t jj = 0; jj < nh; ++jj)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(qf.data() + jj * D + 16 * c, vld(qrow + jj * qs1 + 16 * c));
      // Scores, block by block (no division per token), sixteen tokens at a time (scores16).
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t t0 = 0, bi = 0; t0 < L; t0 += BS, ++bi) {
        const int64_t n = std::min(BS, L - t0);
        const T* kb = kblock(bi);
        if (bi + PF < nb) prefetch_rows<_MM_HINT_T1>(kblock(bi + PF), BS, row, span * sizeof(T));
        else if (bi + PF == nb) prefetch_rows<_MM_HINT_T1>(vblock(0), BS, row, span * sizeof(T));
        for (int64_t hh = 0; hh < hpi; ++hh)
          for (int64_t o0 = 0; o0 < n; o0 += 16) {
            const int64_t m = std::min<int64_t>(16, n - o0);
            for (int64_t j = 0; j < G; ++j) {
              const int64_t jj = hh * G + j;
              const __m512 sv = scores16<T, C>(qf.data() + jj * D, qrow + jj * qs1, kb + o0 * row + hh * D, row, m);
              _mm512_mask_storeu_ps(scores.data() + jj * L + t0 + o0, tail_mask(m), _mm512_mul_ps(sv, vscale));
            }
          }
      }
      for (int64_t jj = 0; jj < nh; ++jj) inv[jj] = softmax_unnormalised(scores.data() + jj * L, L);
      // Weighted sum of values, block by block; a head's accumulator is in C registers while it
      // takes a block's tokens, in `acc` between blocks. bfloat16 on AVX512-BF16 (blocks of an
      // even size): two tokens a step by vdpbf16ps (values_block_pairs).
      bool by_pairs = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) by_pairs = BS % 2 == 0;
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t pws = (L + 1) / 2;
#if defined(__AVX512BF16__)
      if (by_pairs) {
        pairs.resize(nh * pws);
        for (int64_t jj = 0; jj < nh; ++jj) probability_pairs(scores.data() + jj * L, L, pairs.data() + jj * pws);
      }
#endif
      for (int64_t bi = 1; bi < std::min(PF, nb); ++bi) prefetch_rows<_MM_HINT_T1>(vblock(bi), BS, row, span * sizeof(T));
      for (int64_t t0 = 0, bi = 0; t0 < L; t0 += BS, ++bi) {
        const int64_t n = std::min(BS, L - t0);
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
        values_heads<T, C>(vb, n, row, hpi, G, scores.data() + t0, L, 1, acc.data());
      }
#if defined(__AVX512BF16__)
      if (by_pairs) {
        std::copy(acc.begin(), acc.end(), acc_pairs.begin());
        for (int64_t jj = 0; jj < nh; ++jj) unpermute_pairs<C>(acc_pairs.data() + jj * D, acc.data() + jj * D);
      }
#endif
      for (int64_t jj = 0; jj < nh; ++jj) {
        T* oj = op + (i * Hq + h0 * G + jj) * D;
        const float* aj = acc.data() + jj * D;
        const float r = inv[jj];
        for (int64_t d = 0; d < D; ++d) st(oj, d, aj[d] * r);
      }
    }
  });
}
#endif

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
static bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for AMX tile state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static inline void configure_tiles() {  // 8 tiles of 16 rows x 64 bytes: 0 = C, 1 = A, 2..7 = B
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

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
                                float scale, torch::Tensor& out) {
  constexpr int64_t D = 16 * C;
  constexpr int64_t PF = 2;  // cache blocks prefetched ahead of the one being read (as tuned on AMX)
  const PagedView<bf16> v(q, kv_cache, qslp, B, out);
  const int64_t Tn = v.Tn, Hq = v.Hq, BS = v.BS, Hkv = v.Hkv, G = v.G, row = v.row;
  const int64_t qs0 = v.qs0, qs1 = v.qs1;
  const bf16 *qp = v.qp, *kp = v.kp, *vp = v.vp;
  bf16* op = v.op;
  const std::vector<int64_t>& req_of = v.req_of;
  // Work items as in the AVX-512 path (the caller checks that an item has at most 16 query heads).
  const int64_t hpi = Tn >= 4 * at::get_num_threads() ? Hkv : 1;
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

// Prefill rows through the AMX path (module note): request b's query rows are q[query_start[b] ..
// + query_len[b]), attending to positions 0 .. seq_lens[b] - 1 (causal with offset), written to the
// same rows of out; other rows of out are left alone. False where the path does not apply (no AMX
// build or CPU, switched off, not bfloat16, head_dim not 64 / 128): the caller uses another path.
bool paged_prefill_attention_(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                              torch::Tensor query_start, torch::Tensor query_len, torch::Tensor seq_lens, double scale) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (!(g_amx_enabled && amx_ready() && q.scalar_type() == torch::kBFloat16 && kv_cache.scalar_type() == torch::kBFloat16 &&
        (q.size(2) == 64 || q.size(2) == 128)))
    return false;
  check_cpu(q, "q");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && q.dim() == 3 && q.stride(2) == 1 &&
                  q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(3) == 0,
              "q [T, Hq, D] (unit stride in D), kv_cache [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out: like q, contiguous");
  auto bt = block_table.to(torch::kInt64).contiguous();
  auto qs = query_start.to(torch::kInt64).contiguous();
  auto ql = query_len.to(torch::kInt64).contiguous();
  auto sl = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = sl.numel();
  TORCH_CHECK(qs.numel() == B && ql.numel() == B && bt.size(0) == B, "query_start, query_len, seq_lens: [B]; block_table: [B, n]");
  const int64_t *qsp = qs.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>(), *slp = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qsp[b] >= 0 && qlp[b] >= 0 && qsp[b] + qlp[b] <= q.size(0) && qlp[b] <= slp[b] &&
                    (slp[b] + kv_cache.size(2) - 1) / kv_cache.size(2) <= bt.size(1),
                "request ", b, ": rows outside q, more queries than positions, or too few blocks");
  if (q.size(2) == 64)
    prefill_attention_amx<4>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsp, qlp, slp, B, static_cast<float>(scale), out);
  else
    prefill_attention_amx<8>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsp, qlp, slp, B, static_cast<float>(scale), out);
  return true;
#else
  (void)out; (void)q; (void)kv_cache; (void)block_table; (void)query_start; (void)query_len; (void)seq_lens; (void)scale;
  return false;
#endif
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale) {
  check_cpu(q, "q");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type() && kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache: contiguous [2, blocks, block_size, Hkv, D] of q's dtype");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(3) == 0,
              "q: [T, Hq, D] with unit stride in D, Hq a multiple of Hkv");
  auto bt = block_table.to(torch::kInt64).contiguous();
  auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  auto sl = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = sl.numel();
  TORCH_CHECK(qsl.numel() == B + 1 && bt.size(0) == B, "query_start_loc: [B + 1], block_table: [B, n]");
  TORCH_CHECK(qsl.data_ptr<int64_t>()[B] == q.size(0), "query_start_loc[-1] must equal q.size(0)");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX: bfloat16, head_dim 64 or 128, blocks of whole 16-token tiles, at most 16 query heads per item.
  const int64_t G = q.size(1) / kv_cache.size(3);
  const bool one_item_fits = G <= 16 && (q.size(1) <= 16 || q.size(0) < 4 * at::get_num_threads());
  if (q.scalar_type() == torch::kBFloat16 && kv_cache.size(2) % 16 == 0 && one_item_fits && g_amx_enabled &&
      amx_ready()) {
    if (q.size(2) == 64) {
      paged_attention_amx<4>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                             sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out);
      return out;
    }
    if (q.size(2) == 128) {
      paged_attention_amx<8>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                             sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out);
      return out;
    }
  }
#endif
  SERVELAB_DISPATCH(q, [&] {
#if defined(__AVX512F__)
    if (q.size(2) == 64) {
      paged_attention_avx512<scalar_t, 4>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                          sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out);
      return;
    }
    if (q.size(2) == 128) {
      paged_attention_avx512<scalar_t, 8>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                          sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out);
      return;
    }
#endif
    paged_attention_impl<scalar_t>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                   sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out);
  });
  return out;
}

// Whether this build and CPU run the AMX path; with `enabled` given, switch it on or off first.
bool set_amx_attention(bool enabled) {
  g_amx_enabled = enabled;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return enabled && amx_ready();
#else
  return false;
#endif
}

// kv_cache[0 | 1] at slot_mapping[t] = k[t] | v[t]: one call and one row copy per (token, head) where
// index_copy_ costs two calls of ~30 us each per layer at decode batch sizes.
void write_kv_(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  check_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache: contiguous [2, blocks, block_size, Hkv, D]");
  const int64_t Hkv = kv_cache.size(3), D = kv_cache.size(4), nslots = kv_cache.size(1) * kv_cache.size(2);
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                    t->scalar_type() == kv_cache.scalar_type() && t->device().is_cpu(),
                "k, v: [T, Hkv, D] of the cache's dtype with unit stride in D");
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t T_ = k.size(0);
  TORCH_CHECK(v.size(0) == T_ && slots.numel() == T_, "k, v and slot_mapping: one row per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "slot_mapping: slot out of range");
  SERVELAB_DISPATCH(kv_cache, [&] {
    scalar_t* kc = kv_cache.data_ptr<scalar_t>();
    scalar_t* vc = kc + nslots * Hkv * D;
    const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
    at::parallel_for(0, T_, 256, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
          std::memcpy(kc + (sp[t] * Hkv + h) * D, kp + t * k0 + h * k1, D * sizeof(scalar_t));
          std::memcpy(vc + (sp[t] * Hkv + h) * D, vp + t * v0 + h * v1, D * sizeof(scalar_t));
        }
    });
  });
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("set_amx_attention(bool enabled) -> bool", &servelab::set_amx_attention);
  m.def("paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, "
        "Tensor query_start, Tensor query_len, Tensor seq_lens, float scale) -> bool");
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("paged_attention", &servelab::paged_attention);
  m.impl("write_kv_", &servelab::write_kv_);
  m.impl("paged_prefill_attention_", &servelab::paged_prefill_attention_);
}
"""

# Bump with every change of _CPP_SOURCE or the shared KERNEL_HEADER (torch caches builds by name).
_EXTENSION_NAME = "servelab_cpu_paged_attention_v16"


def _register_fakes() -> None:
    @torch.library.register_fake("servelab::write_kv_")
    def _(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("servelab::paged_prefill_attention_")
    def _(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
          query_start: torch.Tensor, query_len: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> bool:
        return False

    @torch.library.register_fake("servelab::paged_attention")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
          seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)


def write_kv_op() -> Any | None:
    """`torch.ops.servelab.write_kv_(kv_cache, k, v, slot_mapping)`, or None where no C++ toolchain builds it."""
    if load_cpu_ops(_EXTENSION_NAME, _CPP_SOURCE, "torch attention backend", _register_fakes):
        return torch.ops.servelab.write_kv_
    return None


def paged_prefill_attention_op() -> Any | None:
    """`torch.ops.servelab.paged_prefill_attention_(out, q, kv_cache, block_table, query_start,
    query_len, seq_lens, scale) -> bool` (prefill rows on AMX; False: not applicable, use
    another path), or None where no C++ toolchain builds it."""
    if load_cpu_ops(_EXTENSION_NAME, _CPP_SOURCE, "torch attention backend", _register_fakes):
        return torch.ops.servelab.paged_prefill_attention_
    return None


def paged_attention_op() -> Any | None:
    """`torch.ops.servelab.paged_attention`, or None where no C++ toolchain builds it."""
    if load_cpu_ops(_EXTENSION_NAME, _CPP_SOURCE, "torch attention backend", _register_fakes):
        return torch.ops.servelab.paged_attention
    return None


def set_amx_attention(enabled: bool) -> bool:
    """Allow (or forbid) the op's AMX path; returns whether it now runs (built for this CPU and
    permitted by the kernel). Off, bfloat16 takes the AVX-512 path: tests and A/B benchmarks run
    both in one process. `SERVELAB_CPU_AMX=0` starts a process with it off."""
    if not load_cpu_ops(_EXTENSION_NAME, _CPP_SOURCE, "torch attention backend", _register_fakes):
        return False
    return bool(torch.ops.servelab.set_amx_attention(enabled))
