// The planned forward's layers in one call (engine/model/planned_layers.py): the same ops in the
// same order as forward_plan.planned_forward's decode-kernel path, each called through the
// dispatcher from here instead of from Python, so a batch-1 step pays one Python call for its 30
// layers instead of ~300 (2-3 us each: SmolLM2's batch-1 step 8.0-9.4 -> 6.2-6.9 ms).
#include "kernel_header.h"
#include <ATen/core/dispatch/Dispatcher.h>
#include <optional>

namespace servelab {
namespace {

using torch::Tensor;
using Next = std::optional<Tensor>;

template <class Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  // typed() checks Fn against the registered kernel's C++ signature: a kernel whose parameters
  // change fails here, at the first call, with the operator's name
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

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
};

const LayerOps& layer_ops() {
  static const LayerOps ops;  // looked up once (thread-safe static initialisation)
  return ops;
}

}  // namespace

// x [T, H] (the embedded tokens; overwritten: it becomes the residual stream) -> the last norm's
// output [T, H]. Per layer i: norms[2i], norms[2i + 1] (input, post-attention); packs[4i .. 4i + 3]
// (qkv, o, gate_up, down as the decode kernels read them); kv_caches[i]. Every query row is one
// decoding request, in row order: block_table [T, n], query_start_loc [T + 1], seq_lens [T] as
// the attention backend passes them to paged_attention. shape: Hq, Hkv, head_dim, qkv width,
// hidden size, intermediate size.
Tensor planned_layers(Tensor x, Tensor cos, Tensor sin, at::TensorList kv_caches, Tensor slot_mapping,
                      Tensor block_table, Tensor query_start_loc, Tensor seq_lens, at::TensorList norms,
                      at::TensorList packs, Tensor final_norm, at::IntArrayRef shape, double eps, double scale) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(packs.size()) == 4 * L,
              "planned_layers: 2 norms and 4 packed matrices per KV cache");
  TORCH_CHECK(shape.size() == 6, "planned_layers: shape is (Hq, Hkv, head_dim, qkv width, hidden, intermediate)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16,
              "planned_layers: x contiguous [T, H] bfloat16");
  const int64_t hq = shape[0], hkv = shape[1], D = shape[2], n_qkv = shape[3], hidden = shape[4], inter = shape[5];
  const int64_t T_ = x.size(0);
  TORCH_CHECK(n_qkv == (hq + 2 * hkv) * D && x.size(1) == hidden, "planned_layers: shape does not match x");
  const LayerOps& k = layer_ops();
  Tensor residual = x;
  for (int64_t i = 0; i < L; ++i) {
    const Tensor* w = packs.data() + 4 * i;
    if (i == 0) {
      x = k.rms_norm.call(residual, norms[0], eps);
    } else {
      k.add_rms_norm.call(x, residual, norms[2 * i], eps);
    }
    // each linear names the next one's weight, as the Python loop does (amx_linear: `next`)
    const Tensor qkv = k.linear.call(x, w[0], n_qkv, Next(w[1])).view({T_, hq + 2 * hkv, D});
    k.rope.call(qkv, cos, sin, hq + hkv);
    k.write_kv.call(kv_caches[i], qkv.narrow(1, hq, hkv), qkv.narrow(1, hq + hkv, hkv), slot_mapping);
    const Tensor o = k.attention.call(qkv.narrow(1, 0, hq), kv_caches[i], block_table, query_start_loc, seq_lens,
                                      scale, false);
    x = k.linear.call(o.view({T_, hq * D}), w[1], hidden, Next(w[2]));
    k.add_rms_norm.call(x, residual, norms[2 * i + 1], eps);
    const Next following = i + 1 < L ? Next(packs[4 * (i + 1)]) : Next();
    x = k.linear.call(k.linear_silu_mul.call(x, w[2], inter, Next(w[3])), w[3], hidden, following);
  }
  k.add_rms_norm.call(x, residual, final_norm, eps);
  return x;
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("planned_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!)[] kv_caches, Tensor slot_mapping, "
        "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, Tensor[] norms, Tensor[] packs, "
        "Tensor final_norm, int[] shape, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) { m.impl("planned_layers", &servelab::planned_layers); }
