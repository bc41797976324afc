// The planned forward's layers in one call (engine/model/planned_layers.py): the same ops in the
// same order as forward_plan.planned_forward's decode-kernel path, each called through the
// dispatcher from here instead of from Python, so a batch-1 step pays one Python call for its 30
// layers instead of ~300 (2-3 us each: SmolLM2's batch-1 step 8.0-9.4 -> 6.2-6.9 ms).
#include "kernel_header.h"
#include "dispatch_ops.h"
#include <ATen/record_function.h>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>
#include "layer_ops.h"
#include "linear_blocks.h"
#include "paged_attention_avx512.h"

namespace servelab {
namespace {

using torch::Tensor;
using Next = std::optional<Tensor>;

// The kernels the layers call (engine/csrc/{amx_linear,layer_ops,paged_attention}.cpp, loaded
// before the first call: the Python side loads them to build its plan).
struct LayerOps {
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t, const Next&)> linear =
      op<Tensor(Tensor, Tensor, int64_t, const Next&)>("servelab::amx_linear");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t, const Next&)> linear_silu_mul =
      op<Tensor(Tensor, Tensor, int64_t, const Next&)>("servelab::amx_linear_silu_mul");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, double)> rms_norm =
      op<Tensor(Tensor, Tensor, double)>("servelab::rms_norm");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, double)> add_rms_norm =
      op<void(Tensor, Tensor, Tensor, double)>("servelab::add_rms_norm_");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, int64_t)> rope =
      op<void(Tensor, Tensor, Tensor, int64_t)>("servelab::rope_");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, Tensor)> write_kv =
      op<void(Tensor, Tensor, Tensor, Tensor)>("servelab::write_kv_");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, double, bool)> attention =
      op<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, double, bool)>("servelab::paged_attention");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t)> argmax =
      op<Tensor(Tensor, Tensor, int64_t)>("servelab::amx_linear_argmax");
};

const LayerOps& layer_ops() {
  static const LayerOps ops;  // looked up once (thread-safe static initialisation)
  return ops;
}

#if defined(SERVELAB_GGUF_BLOCKS) && defined(__AVX512F__)
#define SERVELAB_DECODE_TEAM 1
#endif

// The team step (below): on until `set_decode_team` says otherwise (engine/kernels/planned_layers.py
// sets it from `kernels.decode_team` when the op loads; tests and A/B benchmarks run both in one
// process). g_team_steps counts its steps.
std::atomic<bool> g_team_enabled{true};
std::atomic<int64_t> g_team_steps{0};

#if defined(SERVELAB_DECODE_TEAM)
// One of a layer's linears on the checkpoint's blocks, run by every thread of the team: each
// quantizes x itself (a few hundred bytes: cheaper than a barrier) and takes its share of the
// weight's column blocks (team.h); silu: the fused gate/up projection's silu(gate) * up.
static void team_linear(const bf16* x, int64_t M, int64_t K, const Tensor& pack, int64_t N, bf16* y,
                        const NextWeight& next, bool silu) {
  static thread_local QuantX xq;
  quantize_x(xq, x, M, K);
  const RowTiles rt(x, M, K, false);
  const uint8_t* w = static_cast<const uint8_t*>(pack.data_ptr());
  auto run = [&](const auto& wt) {
    if (silu)
      silu_mul_into(rt, wt, N, y, next);
    else
      linear_into(rt, wt, N, y, next);
  };
  if (packed_kind(pack.size(2)) == static_cast<int>(BlockKind::Q4_1))
    run(GgufBlocks<BlockKind::Q4_1>{w, pack.size(0), pack.size(1), &xq});
  else
    run(GgufBlocks<BlockKind::Q8_0>{w, pack.size(0), pack.size(1), &xq});
}

// The LM head's fused argmax (amx_linear_argmax) on the checkpoint's blocks, run by every thread
// of the team: each quantizes x itself, the chunks split as there, one merge; ids [M].
static void team_argmax(const bf16* x, int64_t M, int64_t K, const Tensor& pack, int64_t N, int64_t* ids,
                        ArgmaxScratch& scratch) {
  static thread_local QuantX xq;
  quantize_x(xq, x, M, K);
  const RowTiles rt(x, M, K, false);
  const uint8_t* w = static_cast<const uint8_t*>(pack.data_ptr());
  if (packed_kind(pack.size(2)) == static_cast<int>(BlockKind::Q4_1))
    argmax_into(rt, GgufBlocks<BlockKind::Q4_1>{w, pack.size(0), pack.size(1), &xq}, N, ids, scratch);
  else
    argmax_into(rt, GgufBlocks<BlockKind::Q8_0>{w, pack.size(0), pack.size(1), &xq}, N, ids, scratch);
}

// A quant_pack result the team step reads (uint8 [NB, KB, tile bytes] of a known kind).
static bool team_pack(const Tensor& p) {
  return p.scalar_type() == torch::kUInt8 && p.dim() == 3 && p.is_contiguous() && p.size(0) > 0 &&
         packed_kind(p.size(2)) >= 0;
}

// Whether the team step runs this call: the checkpoint's blocks for every matrix, rows few enough
// that paged_attention takes its AVX-512 path (kAmxMinRows), a head size it has a path for, the
// inputs laid out as the loops read them, and no profiler listening (it would see one op where the
// dispatcher path shows every kernel by name).
static bool team_applies(const Tensor& x, const Tensor& cos, const Tensor& sin, at::TensorList kv_caches,
                         at::TensorList norms, const Tensor& final_norm, at::TensorList packs, int64_t D,
                         int64_t hidden) {
  if (!g_team_enabled.load(std::memory_order_relaxed) || at::hasCallbacks() || x.size(0) >= kAmxMinRows ||
      (D != 64 && D != 128) || !cos.is_contiguous() || !sin.is_contiguous() || cos.numel() != x.size(0) * D ||
      sin.numel() != x.size(0) * D || cos.scalar_type() != torch::kBFloat16 || sin.scalar_type() != torch::kBFloat16)
    return false;
  for (const Tensor& c : kv_caches)
    if (c.scalar_type() != torch::kBFloat16 || !c.is_contiguous() || c.dim() != 5 || c.size(4) != D) return false;
  if (!std::all_of(packs.begin(), packs.end(), team_pack)) return false;
  auto norm_ok = [&](const Tensor& n) {
    return n.scalar_type() == torch::kBFloat16 && n.is_contiguous() && n.numel() == hidden;
  };
  return norm_ok(final_norm) && std::all_of(norms.begin(), norms.end(), norm_ok);
}

// The layers of a decode step of a few rows in one parallel region: the same kernels as the
// dispatcher path below (the same loops, the same split of every linear's blocks and attention's
// units over the threads, so the same numbers bit for bit: tests/test_planned_layers.py), met at
// barriers instead of started and joined per op. A batch-1 step runs ~270 ops; each call through
// the dispatcher, its allocation and its fork and join cost microseconds, more right after the
// weights have streamed through the caches (benchmarks/cold_after_stream.py).
template <int C>
static Tensor team_layers(Tensor x, const Tensor& cos, const Tensor& sin, at::TensorList kv_caches,
                          const Tensor& slot_mapping, const Tensor& block_table, const Tensor& query_start_loc,
                          const Tensor& seq_lens, at::TensorList norms, at::TensorList packs, const Tensor& final_norm,
                          int64_t hq, int64_t hkv, int64_t hidden, int64_t inter, double eps, double scale,
                          const Tensor* head, int64_t vocab, int64_t* ids) {
  constexpr int64_t D = 16 * C;
  const int64_t L = static_cast<int64_t>(kv_caches.size()), T_ = x.size(0), n_qkv = (hq + 2 * hkv) * D;
  const float e = static_cast<float>(eps);
  auto h = torch::empty({T_, hidden}, x.options());
  auto qkv = torch::empty({T_, hq + 2 * hkv, D}, x.options());
  auto attn = torch::empty({T_, hq, D}, x.options());
  auto mid = torch::empty({T_, inter}, x.options());
  const Tensor q = qkv.narrow(1, 0, hq), k = qkv.narrow(1, hq, hkv), v = qkv.narrow(1, hq + hkv, hkv);
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const auto bt = block_table.to(torch::kInt64).contiguous();
  const auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  const auto sl = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == T_ && sl.numel() == T_ && qsl.numel() == T_ + 1 && bt.size(0) == T_,
              "planned_layers: one decode row per request");
  // checked here, before the region: an exception inside it would end the process
  const int64_t nslots = kv_caches[0].size(1) * kv_caches[0].size(2);
  const int64_t *slot_at = slots.data_ptr<int64_t>(), *qs_at = qsl.data_ptr<int64_t>(), *sl_at = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(slot_at[t] >= 0 && slot_at[t] < nslots, "slot_mapping: slot out of range");
    TORCH_CHECK(qs_at[t] == t && qs_at[t + 1] == t + 1, "query_start_loc: one query row per request, in order");
    TORCH_CHECK(sl_at[t] >= 1 && (sl_at[t] + kv_caches[0].size(2) - 1) / kv_caches[0].size(2) <= bt.size(1),
                "seq_lens: each request's context within its block table");
  }
  std::vector<NextWeight> next;  // the hand-off of pack j: pack j + 1's first blocks (none after the last)
  next.reserve(packs.size());
  for (size_t j = 0; j < packs.size(); ++j)
    next.emplace_back(j + 1 < packs.size() ? std::optional<Tensor>(packs[j + 1]) : std::nullopt);
  auto result = torch::empty({T_, hidden}, x.options());  // the final norm's output (hp is read until the end)
  bf16 *xp = x.data_ptr<bf16>(), *hp = h.data_ptr<bf16>(), *qkvp = qkv.data_ptr<bf16>();
  bf16* rp = result.data_ptr<bf16>();
  bf16 *ap = attn.data_ptr<bf16>(), *mp = mid.data_ptr<bf16>();
  const bf16 *cp = cos.data_ptr<bf16>(), *sp = sin.data_ptr<bf16>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  ArgmaxScratch head_scratch;
  const int threads = std::max(1, at::get_num_threads());
  // the attention's context segments: at most 2 per thread for each row's Hq query heads
  // (context_segments), so no layer resizes the scratch inside the region
  SegmentScratch scratch;
  scratch.reserve(T_ * 2 * threads * hq, D);
  const int64_t rows = T_ * hidden;
#pragma omp parallel num_threads(threads)
  {
    const TeamScope team;
    // Every thread keeps the residual stream and each norm's output itself (a few KB): each norm
    // runs on every thread, from the shared output of the linear before it, with no barrier after
    // it (the next linear reads only this thread's copy); the same sums as one thread's.
    static thread_local std::vector<bf16> res_v, nrm_v;
    res_v.resize(rows);
    nrm_v.resize(rows);
    bf16 *res = res_v.data(), *nrm = nrm_v.data();
    // nrm = the shared linear output yp; res += nrm; nrm = norm(res) * w (add_rms_norm_ in place)
    auto add_norm = [&](const bf16* yp, const Tensor& w) {
      std::memcpy(nrm, yp, rows * sizeof(bf16));
      add_rms_norm_impl<bf16>(nrm, res, w.data_ptr<bf16>(), T_, hidden, e);
    };
    std::memcpy(res, xp, rows * sizeof(bf16));
    for (int64_t i = 0; i < L; ++i) {
      const Tensor* w = packs.data() + 4 * i;
      if (i == 0)
        rms_norm_impl<bf16>(res, nrm, norms[0].data_ptr<bf16>(), T_, hidden, e);
      else
        add_norm(hp, norms[2 * i]);
      team_linear(nrm, T_, hidden, w[0], n_qkv, qkvp, next[4 * i], false);
      team_single([&] {
        rope_impl<bf16>(qkvp, cp, sp, T_, hq + 2 * hkv, D, hq + hkv);
        write_kv_rows<bf16>(kv_caches[i], k, v, slp, T_);
      });
      Tensor out = attn;
      paged_attention_avx512<bf16, C>(q, kv_caches[i], bt.data_ptr<int64_t>(), bt.size(1), qsl.data_ptr<int64_t>(),
                                      sl.data_ptr<int64_t>(), T_, static_cast<float>(scale), out, false, &scratch);
      team_linear(ap, T_, hq * D, w[1], hidden, hp, next[4 * i + 1], false);
      add_norm(hp, norms[2 * i + 1]);
      team_linear(nrm, T_, hidden, w[2], inter, mp, next[4 * i + 2], true);
      team_linear(mp, T_, inter, w[3], hidden, hp, next[4 * i + 3], false);
    }
    add_norm(hp, final_norm);
    if (omp_get_thread_num() == 0) {  // the outputs (nothing in the region reads x or result)
      std::memcpy(rp, nrm, rows * sizeof(bf16));
      std::memcpy(xp, res, rows * sizeof(bf16));
    }
    if (head) team_argmax(nrm, T_, hidden, *head, vocab, ids, head_scratch);
  }
  g_team_steps.fetch_add(1, std::memory_order_relaxed);
  return result;
}
#endif

}  // namespace

// Whether planned_layers runs its team step where it applies; with `enabled` given, switch it first.
bool set_decode_team(std::optional<bool> enabled) {
  if (enabled.has_value()) g_team_enabled.store(*enabled);
#if defined(SERVELAB_DECODE_TEAM)
  return g_team_enabled.load();
#else
  return false;
#endif
}

// How many steps the team step has run in this process.
int64_t decode_team_steps() { return g_team_steps.load(); }

// x [T, H] (the embedded tokens; overwritten: it becomes the residual stream) -> the last norm's
// output [T, H]. Per layer i: norms[2i], norms[2i + 1] (input, post-attention); packs[4i .. 4i + 3]
// (qkv, o, gate_up, down as the decode kernels read them); kv_caches[i]. Every query row is one
// decoding request, in row order: block_table [T, n], query_start_loc [T + 1], seq_lens [T] as
// the attention backend passes them to paged_attention. shape: Hq, Hkv, head_dim, qkv width,
// hidden size, intermediate size.
// head: also the LM head's argmax of the output (amx_linear_argmax with `vocab` columns) into *ids.
Tensor planned_layers(Tensor x, Tensor cos, Tensor sin, at::TensorList kv_caches, Tensor slot_mapping,
                      Tensor block_table, Tensor query_start_loc, Tensor seq_lens, at::TensorList norms,
                      at::TensorList packs, Tensor final_norm, at::IntArrayRef shape, double eps, double scale,
                      const Tensor* head = nullptr, int64_t vocab = 0, Tensor* ids = nullptr) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(packs.size()) == 4 * L,
              "planned_layers: 2 norms and 4 packed matrices per KV cache");
  TORCH_CHECK(shape.size() == 6, "planned_layers: shape is (Hq, Hkv, head_dim, qkv width, hidden, intermediate)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16,
              "planned_layers: x contiguous [T, H] bfloat16");
  const int64_t hq = shape[0], hkv = shape[1], D = shape[2], n_qkv = shape[3], hidden = shape[4], inter = shape[5];
  const int64_t T_ = x.size(0);
  TORCH_CHECK(n_qkv == (hq + 2 * hkv) * D && x.size(1) == hidden, "planned_layers: shape does not match x");
#if defined(SERVELAB_DECODE_TEAM)
  if (team_applies(x, cos, sin, kv_caches, norms, final_norm, packs, D, hidden) &&
      (!head || (team_pack(*head) && head->size(0) == (vocab + 31) / 32 && head->size(1) * 32 == hidden))) {
    int64_t* idp = nullptr;
    if (head) {
      *ids = torch::empty({T_}, x.options().dtype(torch::kInt64));
      idp = ids->data_ptr<int64_t>();
    }
    if (D == 64)
      return team_layers<4>(x, cos, sin, kv_caches, slot_mapping, block_table, query_start_loc, seq_lens, norms, packs,
                            final_norm, hq, hkv, hidden, inter, eps, scale, head, vocab, idp);
    return team_layers<8>(x, cos, sin, kv_caches, slot_mapping, block_table, query_start_loc, seq_lens, norms, packs,
                          final_norm, hq, hkv, hidden, inter, eps, scale, head, vocab, idp);
  }
#endif
  const LayerOps& k = layer_ops();
  Tensor residual = x;
  // Under the profiler each part runs in a range named as forward_plan.planned_forward names its own
  // (`servelab::plan:<part>`, PLAN_PARTS there): servelab-explain attributes the kernels by part.
  // Unprofiled a range costs a check of the thread's callbacks.
  for (int64_t i = 0; i < L; ++i) {
    const Tensor* w = packs.data() + 4 * i;
    {
      RECORD_USER_SCOPE(kPlanNorm);
      if (i == 0)
        x = k.rms_norm.call(residual, norms[0], eps);
      else
        k.add_rms_norm.call(x, residual, norms[2 * i], eps);
    }
    Tensor qkv, o;
    {
      RECORD_USER_SCOPE(kPlanLinears);
      // each linear names the next one's weight, as the Python loop does (amx_linear: `next`)
      qkv = k.linear.call(x, w[0], n_qkv, Next(w[1])).view({T_, hq + 2 * hkv, D});
    }
    {
      RECORD_USER_SCOPE(kPlanAttention);
      k.rope.call(qkv, cos, sin, hq + hkv);
      k.write_kv.call(kv_caches[i], qkv.narrow(1, hq, hkv), qkv.narrow(1, hq + hkv, hkv), slot_mapping);
      o = k.attention.call(qkv.narrow(1, 0, hq), kv_caches[i], block_table, query_start_loc, seq_lens, scale, false);
    }
    {
      RECORD_USER_SCOPE(kPlanLinears);
      x = k.linear.call(o.view({T_, hq * D}), w[1], hidden, Next(w[2]));
    }
    {
      RECORD_USER_SCOPE(kPlanNorm);
      k.add_rms_norm.call(x, residual, norms[2 * i + 1], eps);
    }
    {
      RECORD_USER_SCOPE(kPlanLinears);  // gate_up with the silu * up fused, then down
      const Next following = i + 1 < L ? Next(packs[4 * (i + 1)]) : Next();
      x = k.linear.call(k.linear_silu_mul.call(x, w[2], inter, Next(w[3])), w[3], hidden, following);
    }
  }
  {
    RECORD_USER_SCOPE(kPlanNorm);
    k.add_rms_norm.call(x, residual, final_norm, eps);
  }
  if (head) *ids = k.argmax.call(x, *head, vocab);
  return x;
}

// planned_layers' arguments that stay the same from step to step (the caches, the norms, the packs,
// the shapes), handed over once: converting SmolLM2's 210 tensors from Python lists at every call
// cost ~55 us of a ~3 ms batch-1 step (engine/model/planned_layers.py: BoundLayers).
// The embedding and the rotary tables too: the step's rows of them are gathered here, where the
// model's forward took two more calls for them (~28 us each right after the weights' stream).
struct LayerArgs : torch::CustomClassHolder {
  Tensor embed, cos_table, sin_table;
  std::vector<Tensor> kv_caches, norms, packs;
  Tensor final_norm;
  std::vector<int64_t> shape;
  double eps, scale;
  LayerArgs(Tensor embed_, Tensor cos_table_, Tensor sin_table_, std::vector<Tensor> kv_caches_,
            std::vector<Tensor> norms_, std::vector<Tensor> packs_, Tensor final_norm_, std::vector<int64_t> shape_,
            double eps_, double scale_)
      : embed(std::move(embed_)), cos_table(std::move(cos_table_)), sin_table(std::move(sin_table_)),
        kv_caches(std::move(kv_caches_)), norms(std::move(norms_)), packs(std::move(packs_)),
        final_norm(std::move(final_norm_)), shape(std::move(shape_)), eps(eps_), scale(scale_) {
    for (const Tensor* t : {&embed, &cos_table, &sin_table})
      TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == torch::kBFloat16 && t->device().is_cpu(),
                  "LayerArgs: the embedding and the rotary tables contiguous [n, width] bfloat16 on the CPU");
    TORCH_CHECK(cos_table.sizes() == sin_table.sizes(), "LayerArgs: cos and sin tables of one shape");
  }
};

// rows [T, width] of table (a new tensor) at idx [T] (int64), each checked against the table's size.
static Tensor gather_rows(const Tensor& table, const Tensor& idx, const char* what) {
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == torch::kInt64 && idx.device().is_cpu(), what, ": [T] int64 on the CPU");
  const auto ic = idx.contiguous();
  const int64_t T_ = ic.numel(), n = table.size(0), w = table.size(1);
  auto out = torch::empty({T_, w}, table.options());
  const int64_t* ip = ic.data_ptr<int64_t>();
  const bf16* src = table.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < n, what, ": ", ip[t], " is outside 0 .. ", n - 1);
    std::memcpy(dst + t * w, src + ip[t] * w, w * sizeof(bf16));
  }
  return out;
}

// The layers of a step from its token ids and positions (head: and the LM head's argmax into *ids).
static Tensor bound_layers(const LayerArgs& a, const Tensor& input_ids, const Tensor& positions, Tensor slot_mapping,
                           Tensor block_table, Tensor query_start_loc, Tensor seq_lens, const Tensor* head = nullptr,
                           int64_t vocab = 0, Tensor* ids = nullptr) {
  Tensor x = gather_rows(a.embed, input_ids, "input_ids");
  const int64_t T_ = x.size(0), D = a.cos_table.size(1);
  const Tensor cos = gather_rows(a.cos_table, positions, "positions").view({T_, 1, D});
  const Tensor sin = gather_rows(a.sin_table, positions, "positions").view({T_, 1, D});
  return planned_layers(std::move(x), cos, sin, a.kv_caches, std::move(slot_mapping), std::move(block_table),
                        std::move(query_start_loc), std::move(seq_lens), a.norms, a.packs, a.final_norm, a.shape, a.eps,
                        a.scale, head, vocab, ids);
}

Tensor planned_layers_bound(const c10::intrusive_ptr<LayerArgs>& a, Tensor input_ids, Tensor positions,
                            Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens) {
  return bound_layers(*a, input_ids, positions, std::move(slot_mapping), std::move(block_table),
                      std::move(query_start_loc), std::move(seq_lens));
}

// A greedy decode step's token ids [T] in one call: the layers, the final norm and the LM head's
// fused argmax (`head`, an amx_linear_argmax weight of `vocab` columns); in the team step the head
// runs in the layers' parallel region, so the step pays no second call, fork or join for it.
Tensor planned_greedy_bound(const c10::intrusive_ptr<LayerArgs>& a, Tensor head, int64_t vocab, Tensor input_ids,
                            Tensor positions, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc,
                            Tensor seq_lens) {
  TORCH_CHECK(vocab > 0, "planned_greedy_bound: vocab must be positive");
  Tensor ids;
  bound_layers(*a, input_ids, positions, std::move(slot_mapping), std::move(block_table), std::move(query_start_loc),
               std::move(seq_lens), &head, vocab, &ids);
  return ids;
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.class_<servelab::LayerArgs>("LayerArgs")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, double, double>());
  m.def("planned_layers_bound(__torch__.torch.classes.servelab.LayerArgs args, Tensor input_ids, Tensor positions, "
        "Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens) -> Tensor");
  m.def("planned_greedy_bound(__torch__.torch.classes.servelab.LayerArgs args, Tensor head, int vocab, "
        "Tensor input_ids, Tensor positions, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens) -> Tensor");
  m.def("set_decode_team(bool? enabled=None) -> bool", &servelab::set_decode_team);
  m.def("decode_team_steps() -> int", &servelab::decode_team_steps);
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("planned_layers_bound", &servelab::planned_layers_bound);
  m.impl("planned_greedy_bound", &servelab::planned_greedy_bound);
}
