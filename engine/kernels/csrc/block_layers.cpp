// The planned forward's layers on the checkpoint's GGUF blocks in one call (engine/kernels/block_layers.py):
// the same ops in the same order as forward_plan.planned_forward's blocks branch (the decode path of
// an AVX2 or scalar CPU, where the AVX-512 packs of planned_layers.cpp do not apply), each called
// through the dispatcher from here instead of from Python. A batch-1 step of SmolLM2 makes ~300 of
// those calls; from Python each paid its interpreter and wrapper cost on top of the dispatch.
// Every kernel is the one the Python loop calls, with the same arguments: the same numbers, bit for
// bit (tests/test_block_layers.py). torch.profiler still names each kernel, inside the plan's part
// ranges (servelab::plan:<part>, forward_plan.PLAN_PARTS).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <string>
#include <vector>

namespace servelab {
namespace block_plan {  // named: every source is also compiled as one unit (tests/test_csrc_targets.py)

using torch::Tensor;

template <class Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  // typed() checks Fn against the registered kernel's C++ signature: a kernel whose parameters
  // change fails here, at the first call, with the operator's name
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

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

constexpr const char* kPlanNorm = "servelab::plan:norm";
constexpr const char* kPlanLinears = "servelab::plan:linears";
constexpr const char* kPlanAttention = "servelab::plan:attention";
constexpr const char* kPlanMlp = "servelab::plan:mlp";

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
  }
};

// The layers and the final norm on the embedded tokens x [T, hidden] (modified: it is the residual
// stream, as in the Python loop) -> [T, hidden]. cos, sin: [T, 1, head_dim]; block_table,
// query_start_loc and seq_lens as the attention backend gives them for its decode rows.
Tensor planned_block_layers_bound(const c10::intrusive_ptr<BlockLayerArgs>& a, Tensor x, Tensor cos, Tensor sin,
                                  Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens) {
  const BlockOps& k = block_ops();
  const int64_t hq = a->shape[0], hkv = a->shape[1], D = a->shape[2], hidden = a->shape[3];
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.is_contiguous(), "planned_block_layers: x [T, ", hidden, "]");
  const int64_t T_ = x.size(0), L = static_cast<int64_t>(a->kv_caches.size());
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

}  // namespace block_plan
}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.class_<servelab::block_plan::BlockLayerArgs>("BlockLayerArgs")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<std::string>, at::Tensor, std::vector<int64_t>, double, double>());
  m.def("planned_block_layers_bound(__torch__.torch.classes.servelab.BlockLayerArgs args, Tensor(a!) x, "
        "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("planned_block_layers_bound", &servelab::block_plan::planned_block_layers_bound);
}
