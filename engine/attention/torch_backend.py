"""Reference attention over the paged KV cache, in plain torch.

Design: once per step (`begin_step`) the backend turns the block table into flat
slot indices for every request's whole context, so each layer only gathers and
attends. Requests with a one-token query (decode) are attended together in one
padded batch; requests with longer queries (prefill chunks, prefix-hit prefills)
are attended one at a time with an explicit causal-with-offset mask. This is the
correctness oracle for the Triton and FlashAttention backends and the default on
a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [B] query row of each decoding request
    slots: torch.Tensor  # [B, Lmax] flat slot of every context position (0 where padded)
    mask: torch.Tensor  # [B, 1, 1, Lmax] True where the position is valid


@dataclass
class _PrefillItem:
    start: int  # first query row
    end: int
    slots: torch.Tensor  # [seq_len] flat slots of the whole context
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when the plain causal mask applies


def context_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of `positions` ([..., L]) for rows of `block_table` ([..., max_blocks])."""
    blocks = torch.gather(block_table.long(), -1, positions // block_size)
    return blocks * block_size + positions % block_size


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values ([T, Hkv, D]) into the paged cache by slot."""
    num_blocks, block_size, hkv, d = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._decode: _DecodeGroup | None = None
        self._prefills: list[_PrefillItem] = []

    def begin_step(self, metadata: AttentionMetadata) -> None:
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        device = metadata.block_table.device
        decode_reqs = [i for i in range(metadata.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        self._decode = self._build_decode(metadata, decode_reqs, device) if decode_reqs else None
        self._prefills = []
        for i in range(metadata.num_reqs):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == 1:
                continue
            seq_len = seq_lens[i]
            pos = torch.arange(seq_len, device=device)
            slots = context_slots(metadata.block_table[i], pos, metadata.block_size)
            ctx = seq_len - q_len
            mask = None
            if ctx > 0:
                # Query j sits at position ctx + j and may see positions <= ctx + j.
                qpos = torch.arange(ctx, seq_len, device=device)
                mask = pos[None, :] <= qpos[:, None]
            self._prefills.append(_PrefillItem(qsl[i], qsl[i + 1], slots, mask))

    @staticmethod
    def _build_decode(metadata: AttentionMetadata, reqs: list[int], device: torch.device) -> _DecodeGroup:
        idx = torch.tensor(reqs, device=device)
        lens = metadata.seq_lens[idx].long()  # [B]
        lmax = int(max(metadata.seq_lens_cpu[i] for i in reqs))
        pos = torch.arange(lmax, device=device)
        valid = pos[None, :] < lens[:, None]  # [B, Lmax]
        pos_b = torch.where(valid, pos[None, :], 0)
        slots = context_slots(metadata.block_table[idx], pos_b, metadata.block_size)
        rows = metadata.query_start_loc[idx].long()
        return _DecodeGroup(rows=rows, slots=slots, mask=valid[:, None, None, :])

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
        num_blocks, block_size, hkv, d = kv_cache.shape[1:]
        flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[self._decode.rows] = self._attend_decode(q, flat, self._decode, scale)
        for item in self._prefills:
            out[item.start : item.end] = self._attend_prefill(q[item.start : item.end], flat, item, scale)
        return out

    @staticmethod
    def _attend_decode(q: torch.Tensor, flat: torch.Tensor, group: _DecodeGroup, scale: float) -> torch.Tensor:
        hq, d = q.shape[1:]
        hkv = flat.shape[2]
        g = hq // hkv
        qd = q[group.rows].view(-1, hkv, g, d).float()  # [B, Hkv, G, D]
        keys = flat[0][group.slots].float()  # [B, Lmax, Hkv, D]
        vals = flat[1][group.slots].float()
        scores = torch.einsum("bhgd,blhd->bhgl", qd, keys) * scale  # [B, Hkv, G, Lmax]
        scores = scores.masked_fill(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhgl,blhd->bhgd", probs, vals)  # [B, Hkv, G, D]
        return o.reshape(-1, hq, d).to(q.dtype)

    @staticmethod
    def _attend_prefill(q: torch.Tensor, flat: torch.Tensor, item: _PrefillItem, scale: float) -> torch.Tensor:
        hq = q.shape[1]
        keys = flat[0][item.slots]  # [S, Hkv, D]
        vals = flat[1][item.slots]
        g = hq // keys.shape[1]
        if g > 1:
            keys = keys.repeat_interleave(g, dim=1)
            vals = vals.repeat_interleave(g, dim=1)
        qt = q.transpose(0, 1)  # [Hq, Q, D]
        kt = keys.transpose(0, 1).to(q.dtype)
        vt = vals.transpose(0, 1).to(q.dtype)
        if item.mask is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=item.mask, scale=scale)
        return o.transpose(0, 1)  # [Q, Hq, D]
