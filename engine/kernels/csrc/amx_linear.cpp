#include "kernel_header.h"
#include <algorithm>
#include <optional>
#include <limits>
#include <vector>
#include "linear_blocks.h"

namespace servelab {

// x [M, K] against a packed weight of either layout: an amx_pack result (int32 [NB, K / 32, 2, 16,
// 16]) or a quant_pack one (uint8 [NB, K / 32, tile bytes]: gguf_blocks.h).
static void check_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous [M, K] bfloat16 on the CPU");
  const bool amx = packed.scalar_type() == torch::kInt32 && packed.dim() == 5 && packed.size(2) == 2 &&
                   packed.size(3) == 16 && packed.size(4) == 16;
  const bool gguf = packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed_kind(packed.size(2)) >= 0;
  TORCH_CHECK((amx || gguf) && packed.is_contiguous() && packed.size(1) * 32 == x.size(1),
              "packed: amx_pack or quant_pack of a [N, K] weight with x's K");
}

// w [N, K] -> [NB][KC][2][16][16] 32-bit words (NB = ceil(N / 32) blocks of 32 columns, KC = K / 32):
// word [nb][kc][h][k2][n] = the bfloat16 pair (w[col][32 kc + 2 k2], w[col][32 kc + 2 k2 + 1]) of
// column col = 32 nb + 16 h + n (zero past N). With interleave = I (w = [gate; up], N = 2 I), block
// nb holds gate columns 16 nb .. + 16 in its first half and the same up columns in its second.
torch::Tensor amx_pack(torch::Tensor w, int64_t interleave) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2, "w: [N, K] bfloat16 on the CPU");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 32 == 0, "amx_pack: K must be a multiple of 32, got ", K);
  const int64_t I = interleave;
  TORCH_CHECK(I == 0 || (N == 2 * I && I % 16 == 0), "amx_pack: interleave I needs N = 2 I and 16 | I");
  const int64_t NB = I ? I / 16 : (N + 31) / 32, KC = K / 32;
  auto out = torch::empty({NB, KC, 2, 16, 16}, w.options().dtype(torch::kInt32));
  const uint32_t* w32 = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kc = 0; kc < KC; ++kc)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t k2 = 0; k2 < 16; ++k2)
            for (int64_t n = 0; n < 16; ++n) {
              const int64_t col = I ? h * I + nb * 16 + n : nb * 32 + h * 16 + n;
              o[(((nb * KC + kc) * 2 + h) * 16 + k2) * 16 + n] = col < N ? w32[col * (K / 2) + kc * 16 + k2] : 0u;
            }
  });
  return out;
}

#if defined(SERVELAB_LINEAR_ANY)
// f(the packed weight as the loops walk it): Bf16Blocks for an amx_pack result, GgufBlocks<K>
// for a quant_pack one (check_linear has told them apart).
template <typename F>
static void with_packed(const torch::Tensor& packed, const RowTiles& rt, const char* what, const F& f) {
  if (packed.scalar_type() == torch::kInt32) {
    TORCH_CHECK(amx_tiles_granted(), what, ": no AMX tile state on this CPU");
    f(Bf16Blocks{reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()), packed.size(0), packed.size(1)});
    return;
  }
#if defined(SERVELAB_GGUF_BLOCKS)
  const uint8_t* w = packed.data_ptr<uint8_t>();
  static thread_local QuantX xq;  // this thread's x of its current linear (no call nests another)
  quantize_x(xq, rt.x, rt.M, rt.K);
  if (packed_kind(packed.size(2)) == static_cast<int>(BlockKind::Q4_1))
    f(GgufBlocks<BlockKind::Q4_1>{w, packed.size(0), packed.size(1), &xq});
  else
    f(GgufBlocks<BlockKind::Q8_0>{w, packed.size(0), packed.size(1), &xq});
#else
  (void)rt;
  TORCH_CHECK(false, what, ": a quant_pack weight needs the AVX512-BF16 and AVX512-VNNI build");
#endif
}

// x's rows as the loops read them: AMX's tile loads read whole tiles of an amx_pack weight's
// rows (the last one a padded copy); every other path reads rows.
static RowTiles row_tiles(const torch::Tensor& x, const torch::Tensor& packed) {
  return RowTiles(x.data_ptr<bf16>(), x.size(0), x.size(1), kPadTiles && packed.scalar_type() == torch::kInt32);
}
#endif

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, const std::optional<torch::Tensor>& next) {
  check_linear(x, packed);
  TORCH_CHECK((N + 31) / 32 == packed.size(0), "amx_linear: N does not match the packed weight");
  auto y = torch::empty({x.size(0), N}, x.options());
#if defined(SERVELAB_LINEAR_ANY)
  const RowTiles rt = row_tiles(x, packed);
  with_packed(packed, rt, "amx_linear", [&](const auto& wt) { linear_into(rt, wt, N, y.data_ptr<bf16>(), NextWeight(next)); });
#else
  TORCH_CHECK(false, "amx_linear: built without AMX or AVX512-BF16");
#endif
  return y;
}

torch::Tensor amx_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t I,
                                  const std::optional<torch::Tensor>& next) {
  check_linear(x, packed);
  TORCH_CHECK(I % 16 == 0 && I / 16 == packed.size(0), "amx_linear_silu_mul: I does not match the packed weight");
  auto y = torch::empty({x.size(0), I}, x.options());
#if defined(SERVELAB_LINEAR_ANY)
  const RowTiles rt = row_tiles(x, packed);
  with_packed(packed, rt, "amx_linear_silu_mul",
              [&](const auto& wt) { silu_mul_into(rt, wt, I, y.data_ptr<bf16>(), NextWeight(next)); });
#else
  TORCH_CHECK(false, "amx_linear_silu_mul: built without AMX or AVX512-BF16");
#endif
  return y;
}

torch::Tensor amx_linear_argmax(torch::Tensor x, torch::Tensor packed, int64_t N) {
  check_linear(x, packed);
  TORCH_CHECK((N + 31) / 32 == packed.size(0) && N > 0, "amx_linear_argmax: N does not match the packed weight");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
#if defined(SERVELAB_LINEAR_ANY)
  const RowTiles rt = row_tiles(x, packed);
  ArgmaxScratch scratch;
  with_packed(packed, rt, "amx_linear_argmax",
              [&](const auto& wt) { argmax_into(rt, wt, N, out.data_ptr<int64_t>(), scratch); });
#else
  TORCH_CHECK(false, "amx_linear_argmax: built without AMX or AVX512-BF16");
#endif
  return out;
}

// ---- the checkpoint's own blocks (gguf_blocks.h): packed here, then read by the ops above ----

torch::Tensor quant_pack(torch::Tensor blocks, std::string kind, torch::Tensor w, int64_t interleave) {
  TORCH_CHECK(kind == "Q4_1" || kind == "Q8_0", "quant_pack: block kind Q4_1 or Q8_0, got ", kind);
#if defined(SERVELAB_GGUF_BLOCKS)
  return kind == "Q4_1" ? pack_gguf_blocks<BlockKind::Q4_1>(blocks, w, interleave)
                        : pack_gguf_blocks<BlockKind::Q8_0>(blocks, w, interleave);
#else
  (void)blocks, (void)w, (void)interleave;
  TORCH_CHECK(false, "quant_pack: built without AVX512-BF16 and AVX512-VNNI");
#endif
}

bool quant_linear_available() {
#if defined(SERVELAB_GGUF_BLOCKS)
  return true;
#else
  return false;
#endif
}

bool amx_linear_available() {
#if defined(SERVELAB_LINEAR_ANY)
  return amx_tiles_granted();
#else
  return false;
#endif
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("amx_pack(Tensor w, int interleave) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int N, Tensor? next=None) -> Tensor");
  m.def("amx_linear_silu_mul(Tensor x, Tensor packed, int I, Tensor? next=None) -> Tensor");
  m.def("amx_linear_argmax(Tensor x, Tensor packed, int N) -> Tensor");
  m.def("amx_linear_available() -> bool", &servelab::amx_linear_available);
  m.def("quant_pack(Tensor blocks, str kind, Tensor w, int interleave) -> Tensor");
  m.def("quant_linear_available() -> bool", &servelab::quant_linear_available);
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("amx_pack", &servelab::amx_pack);
  m.impl("amx_linear", &servelab::amx_linear);
  m.impl("amx_linear_silu_mul", &servelab::amx_linear_silu_mul);
  m.impl("amx_linear_argmax", &servelab::amx_linear_argmax);
  m.impl("quant_pack", &servelab::quant_pack);
}
