// The decode linears on a GGUF checkpoint's blocks as stored (Q4_1, Q8_0, Q5_0 here; the K-quants
// Q4_K and Q6_K in kquant_blocks.h), on any CPU: an
// AVX2 path (with FMA and F16C: x86-64-v3, the hosted CI runners, AMD cloud machines, laptops) and a
// scalar reference that builds with no x86 flags at all (an ARM machine gets a correct engine and a
// place for NEON in the same dispatch). engine/model/cpu_blocks.py is the Python side.
//
// GGUF blocks (uint8 [N, K / 32, block bytes], each output column's blocks in input order):
//   Q4_1 (20 bytes): d, m fp16; 16 bytes, input j in the low nibble of byte j, input j + 16 in the
//                    high one; w = d q + m, q in 0..15.
//   Q8_0 (34 bytes): d fp16; 32 int8; w = d q.
//   Q5_0 (22 bytes): d fp16; 4 bytes of fifth bits (bit j = input j); 16 bytes of nibbles as Q4_1;
//                    w = d (q - 16), q in 0..31.
// block_pack lays each column out once, at load time, as its KB blocks' quant bytes (Q4_1 16, Q8_0 32,
// Q5_0 20: the fifth bits, then the nibbles) followed by their d scales and (Q4_1) their m scales,
// each an fp16 array padded with zeros to KB8 = KB rounded up to 8: the same bytes per weight, but
// eight blocks' scales convert in one instruction (vcvtph2ps) and Q4_1's m sx terms of eight blocks
// in one multiply-add, where the blocks as stored took two scalar conversions per block.
// Activations: each row's 32-input block is written as s v_k with s = max_k |x_k| / 16256 and
// v_k = round(x_k / s) in [-16256, 16256] (about 14 bits, where llama.cpp's AVX2 path keeps 8),
// split v = 128 hi + lo with hi in [-127, 127], lo in [-64, 64]: two signed bytes per input. A block's
// integer sum over its 32 products is 128 A_hi + A_lo, exact in int32; per block and column
//   Q4_1: y += d s (128 A_hi + A_lo) + m sx          (sx: the block's float32 sum of x)
//   Q8_0: y += d s (128 A_hi + A_lo)
//   Q5_0: y += d s (128 A_hi + A_lo) - 16 d sx
// AVX2 has no byte dot product instruction (VNNI), so `vpmaddubsw` multiplies 32 unsigned weight bytes
// by 32 signed activation bytes into 16 saturating int16 pair sums, and `vpmaddwd` widens them into
// int32: Q4_1 / Q5_0's unsigned nibbles (<= 31) times a byte of at most 127 never saturate; Q8_0's
// signed weights go in as |q| with the sign moved onto the activation (`vpsignb`), at most
// 2 * 128 * 127 = 32512. The scalar path computes the same integers, so the two differ only in the
// order of the float32 sums. The one rounding beyond float32's is x's to 14 bits: at most s / 2 per
// input, 2^-15 of its block's largest |x| (bfloat16 keeps 2^-9 of each value); tests/test_cpu_blocks.py
// holds both paths against float64 with that bound.
#include "block_columns.h"

namespace servelab {

// The instruction set this build multiplies blocks with: "avx2" or "scalar".
std::string block_linear_isa() {
#if defined(SERVELAB_BLOCKS_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// GGUF blocks uint8 [N, K / block weights, block bytes] -> the packed columns uint8 [N, column bytes]
// (module note; the K-quants' in kquant_blocks.h).
torch::Tensor block_pack(torch::Tensor w, std::string kind) {
  using blocks::Kind;
  const Kind k = blocks::kind_of(kind);
  const int64_t BB = blocks::block_bytes(k), BW = blocks::block_weights(k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 3 && w.size(2) == BB,
              "block_pack: GGUF blocks uint8 [N, K / ", BW, ", ", BB, "] for ", kind);
  auto src = w.contiguous();
  const int64_t N = src.size(0), NB = src.size(1), KB = NB * BW / 32, KB8 = blocks::padded8(KB);
  const int64_t CB = blocks::column_bytes(k, KB);
  auto out = torch::zeros({N, CB}, src.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint8_t* col = op + n * CB;
      const uint8_t* blk = sp + n * NB * BB;
      if (k == Kind::Q6_K) {
        std::memcpy(col, blk, NB * BB);  // as stored
      } else if (k == Kind::Q4_K) {
        for (int64_t b = 0; b < NB; ++b) blocks::pack_q4k(blk + b * BB, col + b * blocks::super_bytes(k));
      } else {
        const int64_t QB = blocks::quant_bytes(k);
        for (int64_t b = 0; b < KB; ++b, blk += BB) {
          std::memcpy(col + b * QB, blk + 2 * blocks::scale_count(k), QB);   // the quant bytes after the scales
          std::memcpy(col + KB * QB + 2 * b, blk, 2);                          // d
          if (k == Kind::Q4_1) std::memcpy(col + KB * QB + 2 * KB8 + 2 * b, blk + 2, 2);  // m
        }
      }
    }
  });
  return out;
}

// x [M, K] (float32 or bfloat16, contiguous) @ the packed columns' matrix [N, K].T -> [M, N] in x's
// dtype. `scalar`: the reference path even where the build has AVX2 (tests compare the two).
torch::Tensor block_linear(torch::Tensor x, torch::Tensor w, std::string kind, bool scalar) {
  using blocks::Kind;
  check_cpu(x, "block_linear x");
  const Kind k = blocks::kind_of(kind);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "block_linear: x [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t BW = blocks::block_weights(k);
  TORCH_CHECK(K % BW == 0, "block_linear: K (", K, ") must be a multiple of ", BW, " for ", kind);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == blocks::column_bytes(k, K / 32),
              "block_linear: packed columns uint8 [N, ", blocks::column_bytes(k, K / 32), "] (block_pack of ", kind,
              " blocks of K = ", K, " inputs), got ", w.sizes());
  const int64_t N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  SERVELAB_DISPATCH(x, [&] {
    blocks::QuantX qx;
    blocks::quantize_x(x.data_ptr<scalar_t>(), M, K, qx);
    // 32 columns a grain: each thread streams a contiguous run of columns
    blocks::linear_columns(qx, wp, y.data_ptr<scalar_t>(), M, N, k, scalar,
                           [&](const auto& run) { at::parallel_for(0, N, 32, run); });
  });
  return y;
}

}  // namespace servelab

TORCH_LIBRARY_FRAGMENT(servelab, m) {
  m.def("block_linear(Tensor x, Tensor packed, str kind, bool scalar=False) -> Tensor");
  m.def("block_pack(Tensor blocks, str kind) -> Tensor");
  m.def("block_linear_isa() -> str", &servelab::block_linear_isa);
}

TORCH_LIBRARY_IMPL(servelab, CPU, m) {
  m.impl("block_linear", &servelab::block_linear);
  m.impl("block_pack", &servelab::block_pack);
}
