"""Reference attention over the paged KV cache, in plain torch (the default on a CPU).

Design (one `begin_step` per step plans the work; each layer only writes, gathers and
attends, so a layer costs a handful of torch ops whatever the batch holds):

- Decode (one-token queries): every decoding request is attended in ONE call. On a CPU
  in float32 that is a small C++ kernel (compiled on first use with torch's
  `cpp_extension`) that reads keys/values straight from the paged cache by block table:
  decode is memory-bound, and this reads the context once instead of three times.
  Elsewhere (or without a C++ toolchain) it is one `scaled_dot_product_attention` call
  over the context gathered block-wise with a single `index_select` (keys and values
  together), passed as strided views; a padding mask only when the lengths differ.
- Fresh prefills (no cached context: the whole sequence is in this step's query) attend
  over this step's own keys/values with `is_causal=True`, never touching the cache;
  consecutive fresh prefills of equal length run as one batched call.
- Prefills over a cached context (prefix hit, later chunks) gather their context
  block-wise and attend with an explicit causal-with-offset mask.
- Grouped-query attention goes through SDPA's `enable_gqa`, never `repeat_interleave`.

This backend is the correctness oracle for the Triton and FlashAttention backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.cpu_extension import load_cpu_extension

# ---- CPU decode kernel (C++, compiled on first use) -------------------------------------
# Reads keys/values straight from the paged cache (no gathered copy): per request, one pass
# over its K rows (all kv heads together) scoring every query head, a softmax, one pass over V.
_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kv_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.is_contiguous(), "layout");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = Hq / Hkv;
  auto bt = block_table.to(torch::kInt64).contiguous();
  auto sl = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty({B, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + NB * BS * Hkv * D;
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t bts = bt.size(1);
  const int64_t* slp = sl.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // One work item per request: each token's K (then V) row holds all Hkv heads contiguously,
  // so the context is streamed once, in order, for all Hq query heads.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(Hq * D), mx(Hq), inv(Hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = slp[b];
      scores.resize(Hq * L);
      const float* qb = qp + b * qs0;
      const int64_t* row = btp + b * bts;
      for (int64_t j = 0; j < Hq; ++j) mx[j] = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < L; ++t) {
        const float* kt = kp + (row[t / BS] * BS + t % BS) * Hkv * D;
        for (int64_t j = 0; j < Hq; ++j) {
          const float* qj = qb + j * qs1;
          const float* k = kt + (j / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qj[d] * k[d];
          s *= sc;
          scores[j * L + t] = s;
          mx[j] = s > mx[j] ? s : mx[j];
        }
      }
      for (int64_t j = 0; j < Hq; ++j) {
        float* sj = scores.data() + j * L;
        const float m = mx[j];
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          const float e = std::exp(sj[t] - m);
          sj[t] = e;
          sum += e;
        }
        inv[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* vt = vp + (row[t / BS] * BS + t % BS) * Hkv * D;
        for (int64_t j = 0; j < Hq; ++j) {
          const float p = scores[j * L + t];
          const float* v = vt + (j / G) * D;
          float* a = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t j = 0; j < Hq; ++j) {
        float* o = op + (b * Hq + j) * D;
        const float* a = acc.data() + j * D;
        for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv[j];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode_attention", &paged_decode_attention); }
"""

def cpu_decode_kernel() -> ModuleType | None:
    """The compiled C++ decode kernel, or None where no C++ toolchain builds it (then torch ops run)."""
    return load_cpu_extension("servelab_cpu_attention_v2", _CPP_SOURCE, "torch attention backend")


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | slice  # query rows of the decoding requests (a slice when contiguous)
    table: torch.Tensor  # [B, nblk] int64 block ids of each decoding request
    lens: torch.Tensor  # [B] int64 context lengths
    num_reqs: int
    max_len: int  # longest context: positions attended are 0 .. max_len - 1
    mask: torch.Tensor | None  # [B, 1, 1, max_len] True where valid; None when all lengths equal


@dataclass
class _PrefillGroup:
    start: int  # first query row
    end: int
    num_reqs: int  # > 1 only for fresh prefills of equal length batched together
    blocks: torch.Tensor | None  # [nblk] context blocks; None: fresh prefill (attend to this step's k/v)
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool for a prefill over a cached context


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values ([T, Hkv, D]) into the paged cache by slot."""
    num_blocks, block_size, hkv, d = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, blocks: torch.Tensor, num_reqs: int, length: int) -> torch.Tensor:
    """Keys and values of `num_reqs` contexts: [2, B, length, Hkv, D] (one copy, block-wise)."""
    block_size, hkv, d = kv_cache.shape[2:]
    kv = kv_cache.index_select(1, blocks)  # [2, B * nblk, bs, Hkv, D]
    return kv.view(2, num_reqs, -1, hkv, d)[:, :, :length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw) -> torch.Tensor:
    """q: [B, Lq, Hq, D], k/v: [B, Lk, Hkv, D] (any strides) -> [B, Lq, Hq, D] (a strided view)."""
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
        enable_gqa=q.shape[2] != k.shape[2], **kw,
    )
    return o.transpose(1, 2)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._decode: _DecodeGroup | None = None
        self._prefills: list[_PrefillGroup] = []

    # ---- per-step plan -----------------------------------------------------------------
    def begin_step(self, metadata: AttentionMetadata) -> None:
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        is_decode = q_lens == 1
        self._decode = self._plan_decode(metadata, np.nonzero(is_decode)[0], seq_lens) if is_decode.any() else None
        self._prefills = self._plan_prefills(metadata, np.nonzero(~is_decode)[0], qsl, seq_lens)

    @staticmethod
    def _plan_decode(metadata: AttentionMetadata, reqs: np.ndarray, seq_lens: np.ndarray) -> _DecodeGroup:
        device = metadata.block_table.device
        bs = metadata.block_size
        lens = seq_lens[reqs]
        max_len = int(lens.max())
        nblk = -(-max_len // bs)
        b = len(reqs)
        qsl = metadata.query_start_loc_cpu
        first = int(reqs[0])
        contiguous = int(reqs[-1]) - first + 1 == b
        if contiguous:
            rows: torch.Tensor | slice = slice(qsl[first], qsl[first] + b)
            table = metadata.block_table[first : first + b, :nblk]
        else:
            idx = torch.from_numpy(reqs).to(device)
            rows = metadata.query_start_loc[idx].long()
            table = metadata.block_table[idx, :nblk]
        mask = None
        if (lens != max_len).any():
            valid = np.arange(max_len)[None, :] < lens[:, None]  # [B, L]
            mask = torch.from_numpy(valid).to(device)[:, None, None, :]
        table = table.long().contiguous()
        return _DecodeGroup(rows, table, torch.from_numpy(lens).to(device), b, max_len, mask)

    @staticmethod
    def _plan_prefills(
        metadata: AttentionMetadata, reqs: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray
    ) -> list[_PrefillGroup]:
        device = metadata.block_table.device
        bs = metadata.block_size
        groups: list[_PrefillGroup] = []
        for i in reqs.tolist():
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q_len = end - start
            ctx = seq_len - q_len
            if ctx == 0:
                last = groups[-1] if groups else None
                if last is not None and last.blocks is None and last.end == start and last.seq_len == seq_len:
                    last.end, last.num_reqs = end, last.num_reqs + 1
                else:
                    groups.append(_PrefillGroup(start, end, 1, None, seq_len, None))
                continue
            nblk = -(-seq_len // bs)
            blocks = metadata.block_table[i, :nblk].long()
            # Query j sits at position ctx + j and may see positions <= ctx + j.
            pos = torch.arange(seq_len, device=device)
            mask = pos[None, :] <= torch.arange(ctx, seq_len, device=device)[:, None]
            groups.append(_PrefillGroup(start, end, 1, blocks, seq_len, mask))
        return groups

    # ---- per layer ---------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
        dec = self._decode
        if dec is not None:
            parts.append((dec.rows, self._attend_decode(q[dec.rows], kv_cache, dec, scale)))
        for g in self._prefills:
            parts.append((slice(g.start, g.end), self._attend_prefill(q, k, v, kv_cache, g, scale)))
        if len(parts) == 1 and isinstance(parts[0][0], slice) and parts[0][1].shape[0] == q.shape[0]:
            return parts[0][1]
        out = torch.empty_like(q)
        for rows, o in parts:
            out[rows] = o
        return out

    @staticmethod
    def _attend_decode(q: torch.Tensor, kv_cache: torch.Tensor, dec: _DecodeGroup, scale: float) -> torch.Tensor:
        """q: [B, Hq, D] one query per decoding request -> [B, Hq, D]."""
        if q.device.type == "cpu" and q.dtype == kv_cache.dtype == torch.float32 and q.stride(-1) == 1:
            kernel = cpu_decode_kernel()
            if kernel is not None:
                return kernel.paged_decode_attention(q, kv_cache, dec.table, dec.lens, scale)
        kv = gather_context(kv_cache, dec.table.view(-1), dec.num_reqs, dec.max_len)
        return _sdpa(q.unsqueeze(1), kv[0], kv[1], scale, attn_mask=dec.mask).squeeze(1)

    @staticmethod
    def _attend_prefill(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, g: _PrefillGroup, scale: float
    ) -> torch.Tensor:
        """[end - start, Hq, D] attention output of one prefill group."""
        n, hq, d = g.end - g.start, q.shape[1], q.shape[2]
        qg = q[g.start : g.end].view(g.num_reqs, n // g.num_reqs, hq, d)
        if g.blocks is None:
            kg = k[g.start : g.end].view(g.num_reqs, n // g.num_reqs, *k.shape[1:])
            vg = v[g.start : g.end].view(g.num_reqs, n // g.num_reqs, *v.shape[1:])
            o = _sdpa(qg, kg, vg, scale, is_causal=True)
        else:
            kv = gather_context(kv_cache, g.blocks, 1, g.seq_len)
            o = _sdpa(qg, kv[0], kv[1], scale, attn_mask=g.mask)
        return o.reshape(n, hq, d)
