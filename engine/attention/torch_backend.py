"""Reference attention over the paged KV cache, in plain torch (the default on a CPU).

Design (one `begin_step` per step plans the work; each layer only writes, gathers and
attends, so a layer costs a handful of torch ops whatever the batch holds):

- Decode (one-token queries): every decoding request is attended in ONE call. On a CPU
  in float32 or bfloat16 that is the C++ op `torch.ops.servelab.paged_attention`
  (`cpu_paged_attention.py`) that reads keys/values straight from the paged cache by block
  table: decode is memory-bound, and this reads the context once instead of three times.
  Elsewhere (or without a C++ toolchain) it is one `scaled_dot_product_attention` call
  over the context gathered block-wise with a single `index_select` (keys and values
  together), passed as strided views; a padding mask only when the lengths differ.
- Otherwise (the two CPU cases below aside) fresh prefills (no cached context: the whole
  sequence is in this step's query) attend over this step's own keys/values with
  `is_causal=True`, never reading the cache; consecutive fresh prefills of equal length run as
  one batched call.
- Prefills over a cached context (prefix hit, later chunks) gather their context
  block-wise and attend with an explicit causal-with-offset mask, in either dtype. The C++
  op handles these rows too (and is tested on them), but on the CPUs measured first (Intel
  Xeons, float32 and bfloat16) SDPA's GEMM-based kernel ran them ~3x faster (4 x 64-token
  chunks after 128 cached tokens, benchmarks/cpu_paged_attention.py), as it did fresh
  prefills (~2.4x), so there they stay on SDPA.
- On a CPU with AMX in bfloat16, every prefill row of the step (fresh or over a cached
  context) goes through one call of the C++ op `paged_prefill_attention_` per layer instead:
  whole 16-row query blocks as tile products over the paged cache (faster than SDPA once per
  prompt on a 1,948-token step of 15 prompts, 2.5x, benchmarks/cpu_paged_attention.py).
- On a CPU with AVX512-BF16 but no AMX, in bfloat16, every row of a step that has prefill rows
  (decode rows too) goes through ONE call of the C++ paged-attention op per layer: its
  vdpbf16ps path beat SDPA once per prompt there (2-core Zen 5: fresh prefill 4 x 128 1.6 against
  3.0 ms, 4 x 64-token chunks after 128 cached tokens 1.5 against 2.2 ms of CPU time,
  benchmarks/cpu_paged_attention.py). Chosen by the CPU's flags, never by a timing probe, so two
  runs on one machine always run the same kernels. float32 stays on SDPA (0.87-1.03x there).
- Grouped-query attention goes through SDPA's `enable_gqa`, never `repeat_interleave`.
- `batch_invariant` (set by the loader for `model.batch_invariant`): every row of every step,
  prefill or decode, through ONE call of the C++ paged-attention op with its split fixed, so a
  row's output is its own query's and context's alone: the same whether its prompt came in one
  chunk or several, alone or beside others (the prefill paths above attend a prompt's rows in
  16-row blocks and differ from the decode path in their sums).

- A sliding window (`forward(..., window=w)`, Gemma 3's local layers) that hides a position of
  the step (some sequence longer than w): every request's rows attend over just the blocks
  holding their last w positions, gathered, with a causal-and-window mask, one SDPA call per
  request (planned once per step and window, `_WindowRows`). Correct first: the C++ paged op
  has no window. A step whose sequences all fit in the window runs the paths above unchanged.
- KV cache groups (`AttentionMetadata.group_metadata`): `begin_step` plans every group's
  metadata; a layer's `forward` with another group's metadata than the last one switches to
  that group's plan (five attribute stores).

This backend is the correctness oracle for the Triton and FlashAttention backends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata, window_excludes
from engine.kernels.paged_attention import (
    paged_attention_op,
    paged_prefill_attention_op,
    prefill_on_paged_op,
    write_kv_op,
)

_OP_DTYPES = (torch.float32, torch.bfloat16)  # the C++ ops' dtypes


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | slice  # query rows of the decoding requests (a slice when contiguous)
    table: torch.Tensor  # [B, nblk] int64 (int32 from OneRowEach) block ids of each decoding request
    lens: torch.Tensor  # [B] int64 context lengths
    num_reqs: int
    max_len: int  # longest context: positions attended are 0 .. max_len - 1
    query_start_loc: torch.Tensor  # [B + 1] int64 0..B: one query row each (for the C++ op)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, 1, max_len] True where valid; None when all lengths are equal (the SDPA path's
        padding mask, made only when that path runs)."""
        if bool((self.lens == self.max_len).all()):
            return None
        return (torch.arange(self.max_len, device=self.lens.device)[None, :] < self.lens[:, None])[:, None, None, :]


@functools.cache
def _one_row_each(b: int, device: torch.device) -> torch.Tensor:
    """query_start_loc of b one-row requests: 0 .. b (int64), made once per size."""
    return torch.arange(b + 1, device=device)


@dataclass
class _PrefillGroup:
    start: int  # first query row
    end: int
    num_reqs: int  # > 1 only for fresh prefills of equal length batched together
    blocks: torch.Tensor | None  # [nblk] context blocks; None: fresh prefill (attend to this step's k/v)
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool for a prefill over a cached context


@dataclass
class _PrefillRows:
    """Every prefill request of the step, for the C++ AMX prefill op (one call per layer)."""

    table: torch.Tensor  # [P, max_blocks] block ids
    query_start: torch.Tensor  # [P] first query row of each
    query_len: torch.Tensor  # [P]
    seq_lens: torch.Tensor  # [P] context length, this step's tokens included


@dataclass
class _StepRows:
    """Every request of a step with prefill rows, for one call of the C++ paged-attention op."""

    num_tokens: int  # query rows of the requests
    table: torch.Tensor  # [B, max_blocks] int64
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64


@dataclass
class _WindowRows:
    """One request's rows in a sliding-window layer: the blocks holding its last `window` positions."""

    start: int  # first query row
    end: int
    blocks: torch.Tensor  # [nblk] int64: the blocks from the one holding `first` to the last
    offset: int  # position `first` within the gathered blocks
    length: int  # positions gathered: the blocks' first position .. seq_len - 1
    mask: torch.Tensor  # [q_len, length - offset] bool: key first + j visible to query row i


def _plan_window(metadata: AttentionMetadata, window: int) -> list[_WindowRows]:
    """Every request of the step under a sliding window of `window` positions: query position p
    sees keys p - window + 1 .. p (HF's `sliding_window_overlay`, llama.cpp's SWA)."""
    bs = metadata.block_size
    qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    device = metadata.block_table.device
    plans = []
    for i in range(metadata.num_reqs):
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        ctx = seq_len - (end - start)
        first = max(0, ctx - window + 1)  # the earliest key any of its rows sees
        first_block = first // bs
        blocks = metadata.block_table[i, first_block : -(-seq_len // bs)].long()
        keys = torch.arange(first, seq_len, device=device)[None, :]  # [1, L]
        queries = torch.arange(ctx, seq_len, device=device)[:, None]  # [q_len, 1]
        mask = (keys <= queries) & (keys > queries - window)
        plans.append(_WindowRows(start, end, blocks, first - first_block * bs, seq_len - first_block * bs, mask))
    return plans


# One step's plan for one metadata (KV cache groups: `begin_step` keeps one per group).
_PlanState = tuple[_DecodeGroup | None, list[_PrefillGroup], _PrefillRows | None, _StepRows | None,
                   dict[int, list[_WindowRows]]]  # fmt: skip

# head dims of the paged op's vector paths (others run its scalar loop: SDPA is faster there)
_OP_VECTOR_HEAD_DIMS = (64, 128)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values ([T, Hkv, D]) into the paged cache by slot."""
    if (
        kv_cache.device.type == "cpu" and kv_cache.dtype in _OP_DTYPES and k.dtype == v.dtype == kv_cache.dtype
        and k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous() and not torch.is_grad_enabled()
    ):
        op = write_kv_op()
        if op is not None:
            op(kv_cache, k, v, slot_mapping)
            return
    num_blocks, block_size, hkv, d = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, blocks: torch.Tensor, num_reqs: int, length: int) -> torch.Tensor:
    """Keys and values of `num_reqs` contexts: [2, B, length, Hkv, D] (one copy, block-wise)."""
    block_size, hkv, d = kv_cache.shape[2:]
    kv = kv_cache.index_select(1, blocks)  # [2, B * nblk, bs, Hkv, D]
    return kv.view(2, num_reqs, -1, hkv, d)[:, :, :length]


def _cpu_op(q: torch.Tensor, kv_cache: torch.Tensor):  # type: ignore[no-untyped-def]
    """The C++ paged-attention op where it applies (CPU, float32 / bfloat16, one dtype), else None."""
    if q.device.type == "cpu" and q.dtype == kv_cache.dtype and q.dtype in _OP_DTYPES and q.stride(-1) == 1:
        return paged_attention_op()
    return None


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
        self._prefill_rows: _PrefillRows | None = None
        self._step_rows: _StepRows | None = None
        self.batch_invariant = False  # module note; engine/kernels/batch_invariance.py sets it
        self._windows: dict[int, list[_WindowRows]] = {}  # this step's plans by window (`_attend_window`)
        # KV cache groups: each group's metadata and plan, and the metadata whose plan is active
        self._group_plans: list[tuple[AttentionMetadata, _PlanState]] = []
        self._active: AttentionMetadata | None = None

    # ---- per-step plan -----------------------------------------------------------------
    def begin_step(self, metadata: AttentionMetadata) -> None:
        self._active = metadata
        if not metadata.group_metadata:
            self._group_plans = []
            self._begin(metadata)
            return
        plans = []
        for md in (*metadata.group_metadata, metadata):  # group 0's plan planned last: active
            self._begin(md)
            plans.append((md, self._plan_state()))
        self._group_plans = plans

    def _plan_state(self) -> _PlanState:
        return self._decode, self._prefills, self._prefill_rows, self._step_rows, self._windows

    def _switch_to(self, metadata: AttentionMetadata) -> None:
        """Make the plan of `metadata` (one of this step's groups) the active one."""
        for md, state in self._group_plans:
            if md is metadata:
                self._decode, self._prefills, self._prefill_rows, self._step_rows, self._windows = state
                self._active = metadata
                return
        raise RuntimeError("attention metadata of no group of this step (begin_step plans every group)")

    def _begin(self, metadata: AttentionMetadata) -> None:
        self._windows = {}
        one = metadata.one_row_each
        if one is not None and not self.batch_invariant:  # decode rows in request order, inputs as the op reads them
            n = metadata.num_reqs
            self._decode = _DecodeGroup(slice(0, n), metadata.block_table, one.seq_lens, n, metadata.max_seq_len,
                                        one.query_start_loc)  # fmt: skip
            self._prefills, self._prefill_rows, self._step_rows = [], None, None
            return
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        if metadata.max_query_len == 1 and not self.batch_invariant:  # a decode step: one row per request
            self._decode = self._plan_decode(metadata, None, seq_lens)
            self._prefills, self._prefill_rows, self._step_rows = [], None, None
            return
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        if self.batch_invariant:  # every row through the paged op (module note)
            self._decode, self._prefills, self._prefill_rows = None, [], None
            nblk = -(-int(seq_lens.max()) // metadata.block_size)
            self._step_rows = _StepRows(int(qsl[-1]), metadata.block_table[: len(seq_lens), :nblk].long().contiguous(),
                                        torch.from_numpy(qsl), torch.from_numpy(seq_lens))
            return
        q_lens = qsl[1:] - qsl[:-1]
        is_decode = q_lens == 1
        self._decode = self._plan_decode(metadata, np.nonzero(is_decode)[0], seq_lens) if is_decode.any() else None
        prefill_reqs = np.nonzero(~is_decode)[0]
        self._prefills = self._plan_prefills(metadata, prefill_reqs, qsl, seq_lens)
        self._prefill_rows = self._step_rows = None
        on_cpu = metadata.block_table.device.type == "cpu"
        if len(prefill_reqs) and on_cpu and prefill_on_paged_op(torch.bfloat16):  # only where it may be used
            nblk = -(-int(seq_lens.max()) // metadata.block_size)
            self._step_rows = _StepRows(
                int(qsl[-1]), metadata.block_table[: len(seq_lens), :nblk].long().contiguous(), torch.from_numpy(qsl),
                torch.from_numpy(seq_lens),
            )
        if len(prefill_reqs) and on_cpu:
            self._prefill_rows = _PrefillRows(
                metadata.block_table[torch.from_numpy(prefill_reqs)],
                torch.from_numpy(qsl[prefill_reqs]), torch.from_numpy(q_lens[prefill_reqs]),
                torch.from_numpy(seq_lens[prefill_reqs]),
            )

    @staticmethod
    def _plan_decode(metadata: AttentionMetadata, reqs: np.ndarray | None, seq_lens: np.ndarray) -> _DecodeGroup:
        """The decoding requests `reqs` (None: every request of the step, in order)."""
        device = metadata.block_table.device
        bs = metadata.block_size
        lens = seq_lens if reqs is None else seq_lens[reqs]
        max_len = int(lens.max())
        nblk = -(-max_len // bs)
        b = len(lens)
        qsl = metadata.query_start_loc_cpu
        first = 0 if reqs is None else int(reqs[0])
        contiguous = reqs is None or int(reqs[-1]) - first + 1 == b
        table = metadata.block_table
        if contiguous:
            rows: torch.Tensor | slice = slice(qsl[first], qsl[first] + b)
            if table.shape[0] != b or table.shape[1] != nblk:  # (a decode step's table has just these)
                table = table[first : first + b, :nblk]
        else:
            assert reqs is not None
            idx = torch.from_numpy(reqs).to(device)
            rows = metadata.query_start_loc[idx].long()
            table = table[idx, :nblk]
        table = table.to(torch.int64, memory_format=torch.contiguous_format)
        lens_t = torch.from_numpy(lens)
        return _DecodeGroup(rows, table, lens_t if device.type == "cpu" else lens_t.to(device), b, max_len,
                            _one_row_each(b, device))  # fmt: skip

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

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """AttentionBackend.decode_rows: a step of decode rows only, on the CPU with the C++ ops
        built, not batch-invariant (its own call), and not observed (engine/hooks.py wraps
        `forward` in a phase range, which a caller bypassing it would skip)."""
        dec = self._decode
        if (
            dec is None or self._prefills or self.batch_invariant or "forward" in vars(self)
            or not isinstance(dec.rows, slice) or dec.rows.start != 0 or dec.table.device.type != "cpu"
            or paged_attention_op() is None or write_kv_op() is None
        ):  # fmt: skip
            return None
        return dec.table, dec.query_start_loc, dec.lens

    # ---- per layer ---------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if metadata is not self._active and self._group_plans:
            self._switch_to(metadata)
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        if window_excludes(metadata, window):
            assert window is not None
            return self._attend_window(q, kv_cache, metadata, scale, window)
        if self.batch_invariant:
            sr, op = self._step_rows, _cpu_op(q, kv_cache)
            assert sr is not None and op is not None, "batch_invariant: the C++ paged-attention op (CPU, bfloat16)"
            return op(q, kv_cache, sr.table, sr.query_start_loc, sr.seq_lens, scale, True)
        dec = self._decode
        pr = self._prefill_rows
        if pr is not None and q.dtype == torch.bfloat16 and kv_cache.dtype == q.dtype and q.stride(-1) == 1:
            op = paged_prefill_attention_op()
            out = torch.empty(q.shape, dtype=q.dtype)
            if op is not None and op(out, q, kv_cache, pr.table, pr.query_start, pr.query_len, pr.seq_lens, scale):
                if dec is not None:
                    out[dec.rows] = self._attend_decode(q[dec.rows], kv_cache, dec, scale)
                return out
        sr = self._step_rows
        if (
            sr is not None and sr.num_tokens == q.shape[0] and q.shape[-1] in _OP_VECTOR_HEAD_DIMS
            and prefill_on_paged_op(q.dtype)
        ):  # fmt: skip
            op = _cpu_op(q, kv_cache)
            if op is not None:
                return op(q, kv_cache, sr.table, sr.query_start_loc, sr.seq_lens, scale)
        parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
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

    def _attend_window(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                       window: int) -> torch.Tensor:  # fmt: skip
        """[T, Hq, D]: every request's rows over its last `window` positions (module note)."""
        plans = self._windows.get(window)
        if plans is None:
            plans = self._windows[window] = _plan_window(metadata, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for w in plans:
            kv = gather_context(kv_cache, w.blocks, 1, w.length)[:, :, w.offset :]  # [2, 1, L, Hkv, D]
            out[w.start : w.end] = _sdpa(q[w.start : w.end].unsqueeze(0), kv[0], kv[1], scale, attn_mask=w.mask)[0]
        return out

    @staticmethod
    def _attend_decode(q: torch.Tensor, kv_cache: torch.Tensor, dec: _DecodeGroup, scale: float) -> torch.Tensor:
        """q: [B, Hq, D] one query per decoding request -> [B, Hq, D]."""
        op = _cpu_op(q, kv_cache)
        if op is not None:
            return op(q, kv_cache, dec.table, dec.query_start_loc, dec.lens, scale)
        kv = gather_context(kv_cache, dec.table.reshape(-1), dec.num_reqs, dec.max_len)
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
