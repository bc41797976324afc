"""Inverse-CDF draws over a vocabulary: one uniform per draw, a two-level search.

Why not the exponential race (argmax w / E, E ~ Exp(1) per token): it draws V exponentials
a row. At 16 rows x 49,152 tokens that was 15.8 ms a step on a CPU, more than the LM head.
Inverse-CDF sampling draws one uniform u per draw and takes the first token whose
cumulative weight exceeds u x (the row's total weight): the same distribution, w / sum(w).

Precision. The weights come in float32 (as softmax computes them). The search has two
levels: the sums of blocks of `BLOCK` tokens (float32, one pass over the row) and their
cumulative sum in float64 (V / BLOCK values) find the block; a float64 cumulative sum inside
that block only finds the token, its target scaled from the block's float32 sum to the
float64 one. So each token's share of its block is exact to ~1e-16, and each block's share of
the row is its float32 sum's (as exact as softmax's float32 normalisation). A float32
cumulative sum over the whole row would instead round each token's width to the ulp of the
running total (~6e-8 of the row's mass), skewing the many tiny tokens.

A zero weight (a masked token) is never drawn: the search takes the first token whose
cumulative sum exceeds the target, which has a positive weight; where rounding puts the
target at or past the end of a block, the block's last token of positive weight is taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256  # tokens per block of the first search level


class Workspace:
    """Float32 buffers kept from step to step, grown to the most rows seen.

    Why: a fresh 3 MB tensor each step (16 x 49,152 float32) is not free on a CPU; with two
    of them live at once the allocator maps one anew every step and its first write pays
    the page faults (1.3 ms measured, more than the sampling arithmetic). One sampling step
    at a time uses a workspace (the runner samples on one thread, step after step)."""

    def __init__(self) -> None:
        self._store: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A contiguous [rows, cols] float32 tensor; its values are whatever was left there."""
        flat = self._store.get(name)
        if flat is None or flat.device != device or flat.numel() < rows * cols:
            flat = torch.empty(max(rows * cols, 1), dtype=torch.float32, device=device)
            self._store[name] = flat
        return flat[: rows * cols].view(rows, cols)

    def weights(self, rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer [rows, B x BLOCK] (B = ceil(vocab / BLOCK)) for `BlockCDF`, and its
        [rows, vocab] view to write the weights into; the padding past `vocab` is zero."""
        blocks = max(1, -(-vocab // BLOCK))
        buf = self.get("weights", rows, blocks * BLOCK, device)
        buf[:, vocab:].zero_()
        return buf, buf[:, :vocab]


class BlockCDF:
    """Searchable cumulative weights of N rows; built once a step, searched per draw."""

    def __init__(self, buf: torch.Tensor) -> None:
        """buf: [N, B x BLOCK] float32 non-negative weights (`Workspace.weights`), not copied:
        it must not change while this object is used."""
        n = buf.shape[0]
        self.blocks = buf.view(n, -1, BLOCK)  # [N, B, BLOCK]
        self.sums = self.blocks.sum(dim=-1)  # [N, B] float32
        self.cum = self.sums.to(torch.float64).cumsum(dim=-1)  # [N, B]
        # The last block of positive weight per row: a target rounded onto the row's end
        # lands there, never in a zero-weight (padding or masked) block.
        num_blocks = self.sums.shape[1]
        self.last_block = (num_blocks - 1) - (self.sums > 0).flip(-1).to(torch.uint8).argmax(dim=-1)  # [N]

    @property
    def total(self) -> torch.Tensor:
        """[N] float64: each row's total weight."""
        return self.cum[:, -1]

    def search(self, u: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """u: [M, R] float64 uniforms in [0, 1) for rows `rows` [M] (None: every row, M = N)
        -> [M, R] int64 token ids, each drawn with probability weight / total of its row."""
        cum, sums, last = self.cum, self.sums, self.last_block
        if rows is not None:
            cum, sums, last = cum[rows], sums[rows], last[rows]
        target = u * cum[:, -1:]  # [M, R]
        block = torch.searchsorted(cum, target, right=True)  # [M, R]
        block = torch.minimum(block, last[:, None])
        before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)  # [M, R]
        row_ix = torch.arange(cum.shape[0], device=cum.device) if rows is None else rows
        weights = self.blocks[row_ix[:, None], block]  # [M, R, BLOCK] float32
        inner = weights.to(torch.float64).cumsum(dim=-1)  # [M, R, BLOCK]
        # The rest of the target inside the block, from the block's float32 sum to its float64 one.
        rest = (target - before) * (inner[..., -1] / sums.gather(1, block).to(torch.float64))
        pos = torch.searchsorted(inner, rest[..., None], right=True).squeeze(-1)  # [M, R]
        last_pos = (BLOCK - 1) - (weights > 0).flip(-1).to(torch.uint8).argmax(dim=-1)  # [M, R]
        return block * BLOCK + torch.minimum(pos, last_pos)


def uniforms(
    generators: list[torch.Generator | None], counts: list[int], device: torch.device
) -> torch.Tensor:
    """[N, max(counts)] float64 uniforms in [0, 1) on `device`.

    Row i takes counts[i] values (the rest of its row is zero): from generators[i] where it
    is set, drawn on the generator's device, so a seed gives the same values whatever device
    samples; None rows share the default generator of `device`. A seeded row's generator
    advances by exactly counts[i], so its draws do not depend on the other rows.
    """
    n, width = len(counts), max(counts, default=0)
    width = max(width, 1)
    if any(g is None and c for g, c in zip(generators, counts, strict=True)):
        out = torch.rand(n, width, dtype=torch.float64, device=device)
    else:
        out = torch.zeros(n, width, dtype=torch.float64, device=device)
    seeded_rows: list[int] = []
    seeded_vals: list[torch.Tensor] = []
    for i, (gen, count) in enumerate(zip(generators, counts, strict=True)):
        if gen is None or count == 0:
            continue
        vals = torch.rand(count, dtype=torch.float64, generator=gen, device=gen.device)
        seeded_rows.append(i)
        seeded_vals.append(F.pad(vals.cpu(), (0, width - count)))
    if seeded_rows:
        # One host -> device copy for all seeded rows (the runner's generators live on the CPU).
        out[torch.tensor(seeded_rows, device=device)] = torch.stack(seeded_vals).to(device)
    return out
