// The planned forward's layers on the checkpoint's GGUF blocks in one call (engine/kernels/block_layers.py):
// the same ops in the same order as forward_plan.planned_forward's blocks branch (the decode path of
// an AVX2 or scalar CPU, where the AVX-512 packs of planned_layers.cpp do not apply), each called
// through the dispatcher from here instead of from Python. A batch-1 step of SmolLM2 makes ~300 of
// those calls; from Python each paid its interpreter and wrapper cost on top of the dispatch.
// Every kernel is the one the Python loop calls, with the same arguments: the same numbers, bit for
// bit (tests/test_block_layers.py). torch.profiler still names each kernel, inside the plan's part
// ranges (servelab::plan:<part>, forward_plan.PLAN_PARTS).
//
// The team step: where the build has no AVX-512 (there paged_attention takes the portable split path,
// whose parts a team can run), no profiler is listening and the arguments are laid out as the loops read
// them, the same kernels' loops run as one OpenMP parallel region for all layers (team.h), met at barriers
// instead of forked and joined ~8 times a layer, with no dispatcher call or allocation per op: the same
// numbers, bit for bit (every linear's column split and the attention's units are the same).
// `kernels.decode_team` switches it (set_block_team).
#include <torch/extension.h>
#include "dispatch_ops.h"
#include <ATen/record_function.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <vector>
#include "block_columns.h"
#include "layer_ops.h"
#include "paged_attention_split.h"
#include "team.h"

namespace servelab {
namespace block_plan {  // named: every source is also compiled as one unit (tests/test_csrc_targets.py)

using torch::Tensor;

// The kernels the loop calls (block_linear.cpp, layer_ops.cpp, paged_attention.cpp: loaded before the
// first call, by the Python side that builds the plan).
struct BlockOps {
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, std::string, bool)> linear =
      op<Tensor(Tensor, Tensor, std::string, bool)>("servelab::block_linear");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, double)> rms_norm =
      op<Tensor(Tensor, Tensor, double)>("servelab::rms_norm");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, double)> add_rms_norm =
      op<void(Tensor, Tensor, Tensor, double)>("servelab::add_rms_norm_");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, int64_t)> rope =
      op<void(Tensor, Tensor, Tensor, int64_t)>("servelab::rope_");
  c10::TypedOperatorHandle<Tensor(Tensor)> silu_mul = op<Tensor(Tensor)>("servelab::silu_mul");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, Tensor)> write_kv =
      op<void(Tensor, Tensor, Tensor, Tensor)>("servelab::write_kv_");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, double, bool)> attention =
      op<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, double, bool)>("servelab::paged_attention");
};

const BlockOps& block_ops() {
  static const BlockOps ops;  // looked up once (thread-safe static initialisation)
  return ops;
}

// What stays the same from step to step, handed over once (engine/kernels/block_layers.py:
// BoundBlockLayers): per layer its KV cache, two norm weights (input, post-attention), four packed
// block matrices (qkv, o, gate_up, down: cpu_blocks.pack) and their block types; the final norm;
// shape (Hq, Hkv, head_dim, hidden); eps and the attention's scale.
struct BlockLayerArgs : torch::CustomClassHolder {
  std::vector<Tensor> kv_caches, norms, blocks;
  std::vector<std::string> kinds;
  Tensor final_norm;
  std::vector<int64_t> shape;
  double eps, scale;
  BlockLayerArgs(std::vector<Tensor> kv_caches_, std::vector<Tensor> norms_, std::vector<Tensor> blocks_,
                 std::vector<std::string> kinds_, Tensor final_norm_, std::vector<int64_t> shape_, double eps_,
                 double scale_)
      : kv_caches(std::move(kv_caches_)), norms(std::move(norms_)), blocks(std::move(blocks_)),
        kinds(std::move(kinds_)), final_norm(std::move(final_norm_)), shape(std::move(shape_)), eps(eps_),
        scale(scale_) {
    const size_t L = kv_caches.size();
    TORCH_CHECK(L > 0 && norms.size() == 2 * L && blocks.size() == 4 * L && kinds.size() == 4 * L,
                "BlockLayerArgs: per layer one KV cache, two norms, four block matrices and their four kinds");
    TORCH_CHECK(shape.size() == 4 && shape[0] > 0 && shape[1] > 0 && shape[2] > 0 && shape[3] > 0,
                "BlockLayerArgs: shape (Hq, Hkv, head_dim, hidden)");
    for (const std::string& k : kinds) kind_ids.push_back(blocks::kind_of(k));
    team_dtype = team_layout();
  }

  std::vector<blocks::Kind> kind_ids;  // `kinds` parsed once
  // The activations' dtype the team step takes these tensors in (norms, final norm and caches of that dtype,
  // float32 or bfloat16, the block matrices laid out as the loops read them); none: the team step never
  // applies. Asked once, here: none of it changes from step to step.
  std::optional<at::ScalarType> team_dtype;

 private:
  std::optional<at::ScalarType> team_layout() const {
    const int64_t hq = shape[0], hkv = shape[1], D = shape[2], hidden = shape[3];
    const auto dt = final_norm.scalar_type();
    if (dt != torch::kFloat && dt != torch::kBFloat16) return std::nullopt;
    auto norm_ok = [&](const Tensor& t) {
      return t.device().is_cpu() && t.scalar_type() == dt && t.is_contiguous() && t.numel() == hidden;
    };
    if (!norm_ok(final_norm) || !std::all_of(norms.begin(), norms.end(), norm_ok)) return std::nullopt;
    for (const Tensor& c : kv_caches)
      if (c.scalar_type() != dt || !c.is_contiguous() || c.dim() != 5 || c.size(0) != 2 || c.size(3) != hkv ||
          c.size(4) != D)
        return std::nullopt;
    const int64_t inter2 = blocks[2].size(0);
    if (inter2 % 2 != 0) return std::nullopt;
    for (size_t i = 0; i < kv_caches.size(); ++i) {  // qkv, o, gate_up, down: [N, column bytes of K inputs]
      const int64_t n[4] = {(hq + 2 * hkv) * D, hidden, inter2, hidden}, k[4] = {hidden, hq * D, hidden, inter2 / 2};
      for (size_t j = 0; j < 4; ++j) {
        const Tensor& w = blocks[4 * i + j];
        const blocks::Kind kd = kind_ids[4 * i + j];
        if (w.scalar_type() != torch::kUInt8 || w.dim() != 2 || !w.is_contiguous() || w.size(0) != n[j] ||
            k[j] % blocks::block_weights(kd) != 0 || w.size(1) != blocks::column_bytes(kd, k[j] / 32))
          return std::nullopt;
      }
    }
    return dt;
  }
};

std::atomic<bool> g_block_team{true};
std::atomic<int64_t> g_block_team_steps{0};

#if !defined(__AVX512F__)
// Whether the team step runs this call (module note): what changes from step to step checked here, the rest
// once by BlockLayerArgs (`team_dtype`); every check made before the region (an exception inside one would
// end the process).
static bool team_applies(const BlockLayerArgs& a, const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t D = a.shape[2], T_ = x.size(0);
  const auto dt = x.scalar_type();
  auto like_x = [&](const Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == dt && t.is_contiguous() && t.numel() == T_ * D;
  };
  return g_block_team.load(std::memory_order_relaxed) && !at::hasCallbacks() && T_ > 0 && a.team_dtype == dt &&
         like_x(cos) && like_x(sin);
}

// One of a layer's linears in the team: each thread quantizes x itself (a few KB: cheaper than a barrier)
// and runs its share of the columns, as block_linear's at::parallel_for would have run them.
template <typename T>
static void team_linear(const T* x, int64_t M, int64_t K, const Tensor& w, blocks::Kind kind, int64_t N, T* y) {
  static thread_local blocks::QuantX xq;
  blocks::quantize_x(x, M, K, xq);
  blocks::linear_columns(xq, w.data_ptr<uint8_t>(), y, M, N, kind, false,
                         [&](const auto& run) { team_for(0, N, run); });
}

// The layers of a decode step in one parallel region (module note). Each thread keeps its own copy of the
// residual stream and of each norm's output (a few KB), so a norm runs on every thread with no barrier after
// it; what one thread must do alone (rotary, the cache write, the attention's plan and merge, SiLU-mul) runs
// on thread 0 between barriers (team_single).
template <typename T>
static Tensor team_layers(const BlockLayerArgs& a, Tensor x, const Tensor& cos, const Tensor& sin,
                          const Tensor& slot_mapping, const Tensor& block_table, const Tensor& query_start_loc,
                          const Tensor& seq_lens) {
  const int64_t hq = a.shape[0], hkv = a.shape[1], D = a.shape[2], hidden = a.shape[3];
  const int64_t T_ = x.size(0), L = static_cast<int64_t>(a.kv_caches.size()), n_qkv = (hq + 2 * hkv) * D;
  const int64_t inter = a.blocks[2].size(0) / 2;
  const float e = static_cast<float>(a.eps);
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const auto bt = block_table.to(torch::kInt64).contiguous();
  const auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  const auto sl = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = sl.numel();
  TORCH_CHECK(slots.numel() == T_ && qsl.numel() == B + 1 && bt.size(0) == B && qsl.data_ptr<int64_t>()[B] == T_,
              "planned_block_layers: slot_mapping [T], query_start_loc [B + 1] ending at T, block_table [B, n]");
  const int64_t nslots = a.kv_caches[0].size(1) * a.kv_caches[0].size(2), BS = a.kv_caches[0].size(2);
  const int64_t *slot_at = slots.data_ptr<int64_t>(), *qs_at = qsl.data_ptr<int64_t>(), *sl_at = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(slot_at[t] >= 0 && slot_at[t] < nslots, "slot_mapping: slot out of range");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qs_at[b] <= qs_at[b + 1] && qs_at[b + 1] - qs_at[b] <= sl_at[b] && (sl_at[b] + BS - 1) / BS <= bt.size(1),
                "request ", b, ": more query rows than positions, or a context past its block table");
  auto qkv = torch::empty({T_, hq + 2 * hkv, D}, x.options());
  auto attn = torch::empty({T_, hq, D}, x.options());
  auto gate_up = torch::empty({T_, 2 * inter}, x.options());
  auto mid = torch::empty({T_, inter}, x.options());
  auto h = torch::empty({T_, hidden}, x.options());
  auto result = torch::empty({T_, hidden}, x.options());
  const Tensor q = qkv.narrow(1, 0, hq), k = qkv.narrow(1, hq, hkv), v = qkv.narrow(1, hq + hkv, hkv);
  T *xp = x.data_ptr<T>(), *qkvp = qkv.data_ptr<T>(), *ap = attn.data_ptr<T>(), *gp = gate_up.data_ptr<T>();
  T *mp = mid.data_ptr<T>(), *hp = h.data_ptr<T>(), *rp = result.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  // The first layer's input norm through the op, before the region: the op's sum is a vectorized reduction
  // whose order the compiler picks per library, and this library's copy summed some rows differently.
  const Tensor first_norm = block_ops().rms_norm.call(x, a.norms[0], a.eps);
  const T* fp = first_norm.data_ptr<T>();
  std::optional<SplitAttention<T>> att;  // this layer's attention: planned on thread 0, run by all
  const int64_t rows = T_ * hidden;
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
    const TeamScope team;
    static thread_local std::vector<T> res_v, nrm_v;
    res_v.resize(rows);
    nrm_v.resize(rows);
    T *res = res_v.data(), *nrm = nrm_v.data();
    // nrm = the shared linear output yp; res += nrm; nrm = norm(res) * w (add_rms_norm_ in place)
    auto add_norm = [&](const T* yp, const Tensor& w) {
      std::memcpy(nrm, yp, rows * sizeof(T));
      add_rms_norm_impl<T>(nrm, res, w.data_ptr<T>(), T_, hidden, e);
    };
    std::memcpy(res, xp, rows * sizeof(T));
    for (int64_t i = 0; i < L; ++i) {
      const Tensor* w = a.blocks.data() + 4 * i;
      const blocks::Kind* kd = a.kind_ids.data() + 4 * i;
      if (i == 0)
        std::memcpy(nrm, fp, rows * sizeof(T));
      else
        add_norm(hp, a.norms[2 * i]);
      team_linear<T>(nrm, T_, hidden, w[0], kd[0], n_qkv, qkvp);
      team_single([&] {
        rope_impl<T>(qkvp, cp, sp, T_, hq + 2 * hkv, D, hq + hkv);
        write_kv_rows<T>(a.kv_caches[i], k, v, slot_at, T_);
        att.emplace(q, a.kv_caches[i], bt.data_ptr<int64_t>(), bt.size(1), qs_at, sl_at, B,
                    static_cast<float>(a.scale), attn, false);
      });
      team_for(0, att->U, [&](int64_t u0, int64_t u1) { att->run(u0, u1); });
      team_single([&] {
        if (att->split) att->merge();
      });
      team_linear<T>(ap, T_, hq * D, w[1], kd[1], hidden, hp);
      add_norm(hp, a.norms[2 * i + 1]);
      team_linear<T>(nrm, T_, hidden, w[2], kd[2], 2 * inter, gp);
      team_single([&] { silu_mul_impl<T>(gp, mp, T_, inter); });
      team_linear<T>(mp, T_, inter, w[3], kd[3], hidden, hp);
    }
    add_norm(hp, a.final_norm);
    if (omp_get_thread_num() == 0) {  // the outputs (nothing in the region reads x or result)
      std::memcpy(rp, nrm, rows * sizeof(T));
      std::memcpy(xp, res, rows * sizeof(T));
    }
  }
  g_block_team_steps.fetch_add(1, std::memory_order_relaxed);
  return result;
}
#endif

// The layers and the final norm on the embedded tokens x [T, hidden] (modified: it is the residual
// stream, as in the Python loop) -> [T, hidden]. cos, sin: [T, 1, head_dim]; block_table,
// query_start_loc and seq_lens as the attention backend gives them for its decode rows.
Tensor planned_block_layers_bound(const c10::intrusive_ptr<BlockLayerArgs>& a, Tensor x, Tensor cos, Tensor sin,
                                  Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens) {
  const BlockOps& k = block_ops();
  const int64_t hq = a->shape[0], hkv = a->shape[1], D = a->shape[2], hidden = a->shape[3];
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.is_contiguous(), "planned_block_layers: x [T, ", hidden, "]");
  const int64_t T_ = x.size(0), L = static_cast<int64_t>(a->kv_caches.size());
#if !defined(__AVX512F__)
  if (team_applies(*a, x, cos, sin)) {
    if (x.scalar_type() == torch::kFloat)
      return team_layers<float>(*a, x, cos, sin, slot_mapping, block_table, query_start_loc, seq_lens);
    return team_layers<at::BFloat16>(*a, x, cos, sin, slot_mapping, block_table, query_start_loc, seq_lens);
  }
#endif
  const Tensor residual = x;
  Tensor h;
  for (int64_t i = 0; i < L; ++i) {
    const Tensor* w = a->blocks.data() + 4 * i;
    const std::string* kind = a->kinds.data() + 4 * i;
    {
      RECORD_USER_SCOPE(kPlanNorm);
      if (i == 0)
        h = k.rms_norm.call(residual, a->norms[0], a->eps);
      else
        k.add_rms_norm.call(h, residual, a->norms[2 * i], a->eps);
    }
    Tensor qkv, o;
    {
      RECORD_USER_SCOPE(kPlanLinears);
      qkv = k.linear.call(h, w[0], kind[0], false).view({T_, hq + 2 * hkv, D});
    }
    {
      RECORD_USER_SCOPE(kPlanAttention);
      k.rope.call(qkv, cos, sin, hq + hkv);
      k.write_kv.call(a->kv_caches[i], qkv.narrow(1, hq, hkv), qkv.narrow(1, hq + hkv, hkv), slot_mapping);
      o = k.attention.call(qkv.narrow(1, 0, hq), a->kv_caches[i], block_table, query_start_loc, seq_lens, a->scale,
                           false);
    }
    {
      RECORD_USER_SCOPE(kPlanLinears);
      h = k.linear.call(o.reshape({T_, hq * D}), w[1], kind[1], false);
    }
    {
      RECORD_USER_SCOPE(kPlanNorm);
      k.add_rms_norm.call(h, residual, a->norms[2 * i + 1], a->eps);
    }
    Tensor gate_up;
    {
      RECORD_USER_SCOPE(kPlanLinears);
      gate_up = k.linear.call(h, w[2], kind[2], false);
    }
    {
      RECORD_USER_SCOPE(kPlanMlp);
      h = k.silu_mul.call(gate_up);
    }
    {
      RECORD_USER_SCOPE(kPlanLinears);
      h = k.linear.call(h, w[3], kind[3], false);
    }
  }
  {
    RECORD_USER_SCOPE(kPlanNorm);
    k.add_rms_norm.call(h, residual, a->final_norm, a->eps);
  }
  return h;
}

// Whether block_layers runs its team step where it applies; with `enabled` given, switch it first.
bool set_block_team(std::optional<bool> enabled) {
  if (enabled.has_value()) g_block_team.store(*enabled);
#if !defined(__AVX512F__)
  return g_block_team.load();
#else
  return false;  // this build's paged_attention is not the split path the team runs
#endif
}

// How many steps the team step has run in this process.
int64_t block_team_steps() { return g_block_team_steps.load(); }

}  // namespace block_plan
}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.class_<servelab::block_plan::BlockLayerArgs>("BlockLayerArgs")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<std::string>, at::Tensor, std::vector<int64_t>, double, double>());
  m.def("planned_block_layers_bound(__torch__.torch.classes.servelab.BlockLayerArgs args, Tensor(a!) x, "
        "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens) -> Tensor");
  m.def("set_block_team(bool? enabled=None) -> bool", &servelab::block_plan::set_block_team);
  m.def("block_team_steps() -> int", &servelab::block_plan::block_team_steps);
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("planned_block_layers_bound", &servelab::block_plan::planned_block_layers_bound);
}
