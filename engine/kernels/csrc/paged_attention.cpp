// Attention straight from the paged KV cache on a CPU (engine/attention/cpu_paged_attention.py):
// the choice of path per call, the KV write, and the op registrations (the portable path, split
// over rows, kv heads and context segments: paged_attention_split.h).
#include "paged_attention_amx.h"
#include "paged_attention_avx512.h"
#include "paged_attention_common.h"
#include "paged_attention_split.h"

namespace servelab {

// Prefill rows through the AMX path (module note): request b's query rows are q[query_start[b] ..
// + query_len[b]), attending to positions 0 .. seq_lens[b] - 1 (causal with offset), written to the
// same rows of out; other rows of out are left alone. False where the path does not apply (no AMX
// build or CPU, switched off, not bfloat16, head_dim not 64 / 128): the caller uses another path.
bool paged_prefill_attention_(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                              torch::Tensor query_start, torch::Tensor query_len, torch::Tensor seq_lens, double scale) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (!(g_amx_enabled && amx_tiles_granted() && q.scalar_type() == torch::kBFloat16 && kv_cache.scalar_type() == torch::kBFloat16 &&
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

// batch_invariant: the path and the work split chosen without regard to the number of rows (one
// kv head per item; AMX wherever an item fits), so each row's result depends on its own query and
// context only (model.batch_invariant).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              bool batch_invariant) {
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
  const bool one_item_fits = G <= 16 && (q.size(1) <= 16 || batch_invariant || q.size(0) < 4 * at::get_num_threads());
  // Under kAmxMinRows query rows the AVX-512 path is as fast or faster (module note); a
  // batch-invariant call keeps one path at every row count.
  const bool enough_rows = batch_invariant || q.size(0) >= kAmxMinRows;
  if (q.scalar_type() == torch::kBFloat16 && kv_cache.size(2) % 16 == 0 && one_item_fits && enough_rows && g_amx_enabled &&
      amx_tiles_granted()) {
    if (q.size(2) == 64) {
      paged_attention_amx<4>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                             sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out, batch_invariant);
      return out;
    }
    if (q.size(2) == 128) {
      paged_attention_amx<8>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                             sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out, batch_invariant);
      return out;
    }
  }
#endif
  SERVELAB_DISPATCH(q, [&] {
#if defined(__AVX512F__)
    if (q.size(2) == 64) {
      paged_attention_avx512<scalar_t, 4>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                          sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out, batch_invariant);
      return;
    }
    if (q.size(2) == 128) {
      paged_attention_avx512<scalar_t, 8>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                          sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out, batch_invariant);
      return;
    }
#endif
    paged_attention_split<scalar_t>(q, kv_cache, bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                    sl.data_ptr<int64_t>(), B, static_cast<float>(scale), out, batch_invariant);
  });
  return out;
}

// Whether this build and CPU run the AMX path; with `enabled` given, switch it on or off first.
bool set_amx_attention(bool enabled) {
  g_amx_enabled = enabled;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return enabled && amx_tiles_granted();
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
  SERVELAB_DISPATCH(kv_cache, [&] { write_kv_rows<scalar_t>(kv_cache, k, v, sp, T_); });
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, bool batch_invariant=False) -> Tensor");
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
