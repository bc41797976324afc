"""Persistent inputs of a CPU decode step whose requests sit in the batch's first rows.

A steady decode step (each request one token, request i in batch row i: one request, or a few
that started together) needs the same handful of tensors every step: input ids, positions,
cache slots, context lengths, the block table. `ModelRunner._prepare_decode` builds them with
~25 numpy and torch calls, and right after a step has streamed ~96 MB of weights each call costs
several times its warm time (benchmarks/cold_after_stream.py): ~0.15 ms of a ~3 ms batch-1 step
with the attention backend's own conversions. Here they live in preallocated tensors written
element by element (a numpy scalar access costs a tenth of a call on a one-element array), with
views made once per row count, and the backend gets the int64 forms its C++ op reads
(`OneRowEach`), so nothing is converted per step.

Two sets alternate by step: with async scheduling step N+1 is prepared while step N still reads
its inputs, and the engine waits for step N before it prepares step N+2. Every input a step reads
is its own set's copy (the block table's rows too), never a view of the batch that a later step's
`_update_states` rewrites.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata, OneRowEach
from engine.worker.input_batch import InputBatch

# Up to this many rows the per-row loop costs less than the vectorised path's calls (each
# ~1 us warm, several after a step's weights have streamed); beyond it the runner's own path.
MAX_ROWS = 8


@dataclass(frozen=True)
class _Views:
    """One set's tensors and their numpy views, first r rows."""

    input_ids: torch.Tensor  # [r] int64
    positions: torch.Tensor  # [r] int64
    slots: torch.Tensor  # [r] int64
    seq_lens: torch.Tensor  # [r] int64
    seq_lens32: torch.Tensor  # [r] int32
    ids_np: np.ndarray
    pos_np: np.ndarray
    slots_np: np.ndarray
    lens_np: np.ndarray
    lens32_np: np.ndarray
    table_np: np.ndarray  # [max_reqs, max_blocks] int32: the whole set's table
    table: torch.Tensor  # the same as a tensor


@dataclass(frozen=True)
class LeadingDecode:
    """One step's inputs (`LeadingDecodeInputs.prepare`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    rows: np.ndarray  # [r] int64 0 .. r - 1 (read only)
    sample_idx: np.ndarray  # [r] int64 0 .. r - 1: every row samples (read only)
    logits_indices: torch.Tensor  # [r] int64 0 .. r - 1


class LeadingDecodeInputs:
    """The persistent tensors (module note); `prepare` fills one step's."""

    def __init__(self, max_reqs: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._sets = [self._allocate(max_reqs, max_blocks) for _ in range(2)]
        self._next = 0  # the set the next step takes
        self._views: dict[tuple[int, int], _Views] = {}
        self._tables: dict[tuple[int, int, int], torch.Tensor] = {}  # (set, r, nblk) -> [r, nblk] view
        self._arange = np.arange(max_reqs + 1, dtype=np.int64)
        self._arange.setflags(write=False)
        self._arange_t = torch.arange(max_reqs + 1, dtype=torch.int64)
        self._qsl32 = torch.arange(max_reqs + 1, dtype=torch.int32)
        self._fixed: dict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _allocate(max_reqs: int, max_blocks: int) -> dict[str, torch.Tensor]:
        i64 = {k: torch.zeros(max_reqs, dtype=torch.int64) for k in ("input_ids", "positions", "slots", "seq_lens")}
        return {**i64, "seq_lens32": torch.zeros(max_reqs, dtype=torch.int32),
                "table": torch.zeros(max_reqs, max_blocks, dtype=torch.int32)}  # fmt: skip

    def _views_of(self, s: int, r: int) -> _Views:
        v = self._views.get((s, r))
        if v is None:
            t = self._sets[s]
            cut = {k: t[k][:r] for k in ("input_ids", "positions", "slots", "seq_lens", "seq_lens32")}
            v = self._views[(s, r)] = _Views(
                **cut, ids_np=cut["input_ids"].numpy(), pos_np=cut["positions"].numpy(), slots_np=cut["slots"].numpy(),
                lens_np=cut["seq_lens"].numpy(), lens32_np=cut["seq_lens32"].numpy(), table_np=t["table"].numpy(),
                table=t["table"],
            )  # fmt: skip
        return v

    def _fixed_of(self, r: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows 0 .. r - 1, logits rows 0 .. r - 1, query starts 0 .. r as int32 and int64)."""
        f = self._fixed.get(r)
        if f is None:
            f = self._fixed[r] = (self._arange[:r], self._arange_t[:r], self._qsl32[: r + 1], self._arange_t[: r + 1])
        return f

    def prepare(self, batch: InputBatch, r: int) -> LeadingDecode | None:
        """The inputs of a decode step of rows 0 .. r - 1 (request i in row i, one token each at its
        computed count); None where a row would not sample (a one-token chunk of a prompt), which
        the runner's own path handles."""
        s = self._next
        self._next ^= 1
        v = self._views_of(s, r)
        bs = self.block_size
        computed, tokens, known, table = batch.num_computed, batch.token_ids, batch.num_tokens, batch.block_table
        lens: list[int] = []
        for i in range(r):
            p = int(computed[i])
            if p + 1 < known[i]:
                return None
            n = p // bs + 1  # blocks holding positions 0 .. p
            v.table_np[i, :n] = table[i, :n]
            v.pos_np[i] = p
            v.ids_np[i] = tokens[i, p]
            v.slots_np[i] = int(table[i, p // bs]) * bs + p % bs
            v.lens_np[i] = v.lens32_np[i] = p + 1
            lens.append(p + 1)
        max_len = max(lens)
        nblk = -(-max_len // bs)
        bt = self._tables.get((s, r, nblk))
        if bt is None:
            bt = self._tables[(s, r, nblk)] = v.table[:r, :nblk]
        rows, logits_rows, qsl32, qsl64 = self._fixed_of(r)
        metadata = AttentionMetadata(
            num_reqs=r, num_tokens=r, query_start_loc=qsl32, seq_lens=v.seq_lens32, slot_mapping=v.slots,
            block_table=bt, max_query_len=1, max_seq_len=max_len, query_start_loc_cpu=list(range(r + 1)),
            seq_lens_cpu=lens, block_size=bs, one_row_each=OneRowEach(v.seq_lens, qsl64),
        )  # fmt: skip
        return LeadingDecode(v.input_ids, v.positions, metadata, rows, rows, logits_rows)
