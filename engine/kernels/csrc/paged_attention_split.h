// Paged attention's portable path (any CPU without AVX-512: AVX2 machines, and the reference that an
// ARM build compiles with no x86 flags): work split over query rows, kv heads and context segments.
//
// One work unit is (query row, context segment): each key / value row of the segment, every kv head
// of it, is read once as one contiguous span (converted to float32 once) for all query heads, the
// unit's rows all prefetched into L2 as it starts (a decode step's weights evict the cache from every level). A
// call with fewer rows than twice the threads (batch-1 decode on 2 threads) cuts each row's context
// into segments of whole cache blocks, attended as separate units and merged by their softmax maxima
// and sums (flash-decoding's split) on the calling thread, so every thread has work. Inner loops over the
// head dimension are `omp simd` (AVX2 or NEON lanes under -march=native); the softmax's exponentials
// 8 lanes at a time where the build has AVX2. `fixed` (model.batch_invariant) never splits, so a
// row's sums do not follow how many rows share the call.
#pragma once
#include "paged_attention_common.h"

namespace servelab {

// s[t] = exp(s[t] - m) for t < n; returns their sum.
static inline float exp_shift_sum(float* s, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = vexp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; t < n; ++t) {
    const float e = exp_approx(s[t] - m);
    s[t] = e;
    sum += e;
  }
  return sum;
}

// One call's work, in three parts a team can run (block_layers.cpp's team step): the plan of units
// (made once, by one thread), `run` over a range of units (any thread: a unit's numbers do not depend
// on which), and `merge` of a split row's segments (one thread, after every unit has run).
template <typename T>
struct SplitAttention {
  struct Unit {
    int64_t i, t0, t1;
  };
  PagedView<T> v;
  const int64_t* btp;
  int64_t bts;
  float scale;
  std::vector<int64_t> L;  // positions row i attends: 0 .. L[i] - 1
  std::vector<Unit> units;
  std::vector<int64_t> first;  // row i: units first[i] .. first[i + 1] - 1
  int64_t U = 0;
  bool split = false;
  std::vector<float> part_max, part_sum, part_acc;  // per unit and query head (split only)

  SplitAttention(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp_, int64_t bts_,
                 const int64_t* qslp, const int64_t* slp, int64_t B, float scale_, torch::Tensor& out, bool fixed)
      : v(q, kv_cache, qslp, B, out), btp(btp_), bts(bts_), scale(scale_), L(v.Tn), first(v.Tn + 1) {
    const int64_t Tn = v.Tn, Hq = v.Hq, D = v.D, BS = v.BS;
    int64_t maxL = 0;
    for (int64_t i = 0; i < Tn; ++i) {
      const int64_t b = v.req_of[i];
      L[i] = slp[b] - (qslp[b + 1] - qslp[b]) + (i - qslp[b]) + 1;
      maxL = std::max(maxL, L[i]);
    }
    const int64_t threads = team_threads();
    int64_t seg = std::max<int64_t>(maxL, 1);  // tokens a unit attends (whole blocks when split)
    if (!fixed && Tn < 2 * threads && maxL > 2 * BS) {
      const int64_t want = (2 * threads + Tn - 1) / Tn;  // segments per row
      seg = std::max<int64_t>(2 * BS, ((maxL + want - 1) / want + BS - 1) / BS * BS);
    }
    for (int64_t i = 0; i < Tn; ++i) {
      first[i] = static_cast<int64_t>(units.size());
      for (int64_t t0 = 0; t0 < L[i]; t0 += seg) units.push_back({i, t0, std::min(L[i], t0 + seg)});
    }
    first[Tn] = static_cast<int64_t>(units.size());
    U = first[Tn];
    split = U > Tn;
    if (split) {
      part_max.resize(U * Hq);
      part_sum.resize(U * Hq);
      part_acc.resize(U * Hq * D);
    }
  }

  void run(int64_t u0, int64_t u1) {
    const int64_t Hq = v.Hq, D = v.D, BS = v.BS, G = v.G, row = v.row;
    std::vector<float> qf(Hq * D), acc(Hq * D), kf(row), scores, mx(Hq), sums(Hq);
    for (int64_t u = u0; u < u1; ++u) {
      const Unit& un = units[u];
      const int64_t n = un.t1 - un.t0;
      const int64_t* blocks = btp + v.req_of[un.i] * bts;
      const auto slot = [&](int64_t t) { return (blocks[t / BS] * BS + t % BS) * row; };
      scores.resize(Hq * n);
      // the unit's keys and values into L2 at once (every line requested before the first is used:
      // the misses overlap instead of queueing one row at a time)
      for (int64_t t = un.t0; t < un.t1; ++t)
        for (int64_t off = 0; off < row * static_cast<int64_t>(sizeof(T)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(v.kp + slot(t)) + off, 0, 2);
          __builtin_prefetch(reinterpret_cast<const char*>(v.vp + slot(t)) + off, 0, 2);
        }
      for (int64_t j = 0; j < Hq; ++j) {
        const T* qj = v.qp + un.i * v.qs0 + j * v.qs1;
        float* f = qf.data() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) f[d] = ld(qj, d) * scale;
      }
      for (int64_t t = un.t0; t < un.t1; ++t) {
        const T* kt = v.kp + slot(t);
#pragma omp simd
        for (int64_t d = 0; d < row; ++d) kf[d] = ld(kt, d);  // the whole row: every kv head
        for (int64_t j = 0; j < Hq; ++j) {
          const float* f = qf.data() + j * D;
          const float* k = kf.data() + (j / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += f[d] * k[d];
          scores[j * n + (t - un.t0)] = s;
        }
      }
      for (int64_t j = 0; j < Hq; ++j) {
        float* sj = scores.data() + j * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = sj[t] > m ? sj[t] : m;
        mx[j] = m;
        sums[j] = exp_shift_sum(sj, n, m);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = un.t0; t < un.t1; ++t) {
        const T* vt = v.vp + slot(t);
#pragma omp simd
        for (int64_t d = 0; d < row; ++d) kf[d] = ld(vt, d);
        for (int64_t j = 0; j < Hq; ++j) {
          const float p = scores[j * n + (t - un.t0)];
          const float* val = kf.data() + (j / G) * D;
          float* a = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * val[d];
        }
      }
      for (int64_t j = 0; j < Hq; ++j) {
        const float* a = acc.data() + j * D;
        if (split) {
          part_max[u * Hq + j] = mx[j];
          part_sum[u * Hq + j] = sums[j];
          std::copy(a, a + D, part_acc.begin() + (u * Hq + j) * D);
        } else {
          T* o = v.op + (un.i * Hq + j) * D;
          const float r = 1.f / sums[j];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) st(o, d, a[d] * r);
        }
      }
    }
  }

  void merge() {
    const int64_t Tn = v.Tn, Hq = v.Hq, D = v.D;
    // Split only where rows are few (under twice the threads): merged here, on the calling thread:
    // out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M the largest segment maximum.
    std::vector<float> o(D);
    for (int64_t i = 0; i < Tn; ++i)
      for (int64_t j = 0; j < Hq; ++j) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t u = first[i]; u < first[i + 1]; ++u) M = std::max(M, part_max[u * Hq + j]);
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t u = first[i]; u < first[i + 1]; ++u) {
          const float w = exp_approx(part_max[u * Hq + j] - M);
          total += w * part_sum[u * Hq + j];
          const float* a = part_acc.data() + (u * Hq + j) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        T* out_row = v.op + (i * Hq + j) * D;
        const float r = 1.f / total;
        for (int64_t d = 0; d < D; ++d) st(out_row, d, o[d] * r);
      }
  }
};

template <typename T>
static void paged_attention_split(const torch::Tensor& q, const torch::Tensor& kv_cache, const int64_t* btp, int64_t bts,
                                  const int64_t* qslp, const int64_t* slp, int64_t B, float scale, torch::Tensor& out,
                                  bool fixed) {
  SplitAttention<T> a(q, kv_cache, btp, bts, qslp, slp, B, scale, out, fixed);
  at::parallel_for(0, a.U, 1, [&](int64_t u0, int64_t u1) { a.run(u0, u1); });
  if (a.split) a.merge();
}

}  // namespace servelab
