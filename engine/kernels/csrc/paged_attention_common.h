// What the paged attention paths share: the AMX switch and the view of the arguments.
#pragma once
#include "kernel_header.h"
#include "team.h"
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <utility>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace servelab {

// Whether the AMX path may run (where it is built and the CPU has it): on until `set_amx_attention`
// says otherwise (engine/kernels/paged_attention.py sets it from `kernels.amx` when the op loads;
// tests and A/B benchmarks run both paths in one process).
static std::atomic<bool> g_amx_enabled{true};

// Fewer query rows than this take the AVX-512 path where AMX is on: a row's tile products leave
// most of the tile unused, and cold-cache decode of SmolLM2's 30 layers at 256 tokens (2 Sapphire
// Rapids cores, per layer) ran 14.5-19.3 us on AVX-512 against 17.2-20.6 on AMX at 1 row, even at
// 2, 46-48 against 49-53 at 4, and 75-76 against 88-90 on AMX's side at 8 (docs/benchmarks-log.md).
constexpr int64_t kAmxMinRows = 8;

// Query heads per work item, as kv heads (hpi): all of them when the call has rows enough to keep
// every thread busy (each cache block then one contiguous read), else one (batch-1 decode). With
// `fixed` (model.batch_invariant) always one, so that how a row is split does not follow how many
// other rows share the call.
static inline int64_t heads_per_item(int64_t Tn, int64_t Hkv, bool fixed) {
  return !fixed && Tn >= 4 * team_threads() ? Hkv : 1;
}

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

// kv_cache[0 | 1] at slot sp[t] = k[t] | v[t] for t < T_ (k, v: [T_, Hkv, D], unit stride in D).
template <typename T>
static void write_kv_rows(const torch::Tensor& kv_cache, const torch::Tensor& k, const torch::Tensor& v,
                          const int64_t* sp, int64_t T_) {
  const int64_t Hkv = kv_cache.size(3), D = kv_cache.size(4), nslots = kv_cache.size(1) * kv_cache.size(2);
  T* kc = kv_cache.data_ptr<T>();
  T* vc = kc + nslots * Hkv * D;
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
  at::parallel_for(0, T_, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kc + (sp[t] * Hkv + h) * D, kp + t * k0 + h * k1, D * sizeof(T));
        std::memcpy(vc + (sp[t] * Hkv + h) * D, vp + t * v0 + h * v1, D * sizeof(T));
      }
  });
}

}  // namespace servelab
