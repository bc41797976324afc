#include "kernel_header.h"
#include "layer_ops.h"
#include <type_traits>
namespace servelab {

static void check(const torch::Tensor& t, const torch::Tensor& like, const char* what) {
  check_cpu(t, what);
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == like.scalar_type(), what, ": contiguous, dtype of x");
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check(x, x, "x"); check(residual, x, "residual"); check(weight, x, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual: one shape");
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  SERVELAB_DISPATCH(x, [&] {
    add_rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), T_, H, static_cast<float>(eps));
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, x, "x"); check(weight, x, "weight");
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  SERVELAB_DISPATCH(x, [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            T_, H, static_cast<float>(eps));
  });
  return out;
}

void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  check(qkv, qkv, "qkv"); check(cos, qkv, "cos"); check(sin, qkv, "sin");
  const int64_t T_ = qkv.size(0), HT = qkv.size(1), D = qkv.size(2);
  TORCH_CHECK(cos.numel() == T_ * D && sin.numel() == T_ * D && heads <= HT, "rope shapes");
  SERVELAB_DISPATCH(qkv, [&] {
    rope_impl<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        T_, HT, D, heads);
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, gate_up, "gate_up");
  const int64_t I = gate_up.size(-1) / 2, T_ = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  SERVELAB_DISPATCH(gate_up, [&] { silu_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), T_, I); });
  return out;
}

// Row r's argmax: the first index of its maximum, a NaN counting as the maximum (the first NaN
// wins), as torch.max(dim=-1).indices. Read in the storage type: no float32 copy of the logits.
template <typename T>
static int64_t argmax_row(const T* x, int64_t V) {
  int64_t i0 = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  bool found = false;  // best holds a value read from the row
#if defined(__AVX512F__)
  if (V >= 16) {
    // Lane l keeps the best of indices l, l + 16, ...: strictly greater (or a first NaN) replaces.
    __m512 bv = vld(x);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = bi;
    const __m512i step = _mm512_set1_epi32(16);
    for (i0 = 16; i0 + 16 <= V; i0 += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = vld(x + i0);
      const __mmask16 nan_v = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan_b = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
      const __mmask16 take = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ) | (nan_v & static_cast<__mmask16>(~nan_b));
      bv = _mm512_mask_mov_ps(bv, take, v);
      bi = _mm512_mask_mov_epi32(bi, take, idx);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, bv);
    _mm512_store_si512(ids, bi);
    for (int l = 0; l < 16; ++l) {
      const float v = vals[l];
      const bool better = !found || (std::isnan(v) ? (!std::isnan(best) || ids[l] < at)
                                                   : (!std::isnan(best) && (v > best || (v == best && ids[l] < at))));
      if (better) { best = v; at = ids[l]; found = true; }
    }
  }
#endif
  for (int64_t i = i0; i < V; ++i) {  // the tail (indices above every lane's): strictly greater
    const float v = ld(x, i);
    if (!found || (std::isnan(v) ? !std::isnan(best) : v > best)) { best = v; at = i; found = true; }
  }
  return at;
}

torch::Tensor argmax_rows(torch::Tensor logits) {
  check(logits, logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits: [N, V] with V > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto out = torch::empty({N}, logits.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  SERVELAB_DISPATCH(logits, [&] {
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * V, V);
    });
  });
  return out;
}

// Row r's near-maximum candidates (module note): the values >= floor, in index order.
template <typename T>
static int64_t near_max_row(const T* x, int64_t V, float floor, int64_t* cols, int64_t k) {
  int64_t count = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 fv = _mm512_set1_ps(floor);
  for (; i + 16 <= V; i += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(vld(x + i), fv, _CMP_GE_OQ);
    while (m) {  // rare: a handful of values per row
      const int l = __builtin_ctz(m);
      if (count < k) cols[count] = i + l;
      ++count;
      m &= m - 1;
    }
  }
#endif
  for (; i < V; ++i) {
    if (ld(x, i) >= floor) {
      if (count < k) cols[count] = i;
      ++count;
    }
  }
  return count;
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> near_max_rows(torch::Tensor logits, double rel, int64_t k) {
  check(logits, logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits: [N, V] with V > 0");
  TORCH_CHECK(k > 0, "k: > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto ids = logits.options().dtype(torch::kInt64);
  auto first = torch::empty({N}, ids), count = torch::empty({N}, ids), cols = torch::full({N, k}, -1, ids);
  int64_t *fp = first.data_ptr<int64_t>(), *np = count.data_ptr<int64_t>(), *cp = cols.data_ptr<int64_t>();
  SERVELAB_DISPATCH(logits, [&] {
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* row = xp + r * V;
        fp[r] = argmax_row(row, V);
        const float top = ld(row, fp[r]);
        if (std::isnan(top)) { np[r] = 0; continue; }
        // floor computed in float32, then rounded to the storage type (nearest even), as torch does
        const float floor = static_cast<float>(static_cast<scalar_t>(top - std::fabs(top) * static_cast<float>(rel)));
        np[r] = near_max_row(row, V, floor, cp + r * k, k);
      }
    });
  });
  return {first, count, cols};
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("near_max_rows(Tensor logits, float rel, int k) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("add_rms_norm_", &servelab::add_rms_norm_);
  m.impl("rms_norm", &servelab::rms_norm);
  m.impl("rope_", &servelab::rope_);
  m.impl("silu_mul", &servelab::silu_mul);
  m.impl("argmax_rows", &servelab::argmax_rows);
  m.impl("near_max_rows", &servelab::near_max_rows);
}
