"""From logits to the weights each row samples from: temperature, top-k, top-p, min-p.

A row's weights are w = exp((x - max x) / T): its softmax times a constant, so the largest
is exactly 1 and no row's probabilities need normalising. Then, in HF's order (top-k, top-p,
min-p; tests/test_sampler_reference.py holds the reference):

- top-k zeroes the tokens whose weight is below the k-th largest (a tie at the k-th value is
  kept, as HF keeps it); the k-th value is found without sorting the row (`_kth_largest`).
- min-p zeroes the tokens whose probability is below min_p x the largest: w < min_p.
- top-p is not a mask here. Token t is in the nucleus iff the weight of the tokens more
  likely than it is below top_p x the row's weight after top-k (HF: the ascending
  cumulative probability at t exceeds 1 - top_p). Finding that set takes a sort; testing
  one token takes a pass over the row. So a top-p row draws from its top-k / min-p weights
  and keeps the first draw inside the nucleus (rejection sampling: what it keeps follows
  w restricted to the nucleus, renormalised, the exact distribution). A draw lands in the
  nucleus with probability >= top_p; each row draws `CANDIDATES` at once, and a row none
  of them satisfies draws again (`resolve_nucleus`), after `ROUNDS` rounds falling back to
  the sorted nucleus.

Ties at the nucleus boundary: HF keeps those of several equal logits that its sort puts
first; here a token's nucleus test counts only strictly larger weights, so equal logits are
kept or dropped together.
"""

from __future__ import annotations

import torch

from engine.sample.inverse_cdf import BlockCDF, Workspace, uniforms
from engine.sampling_params import SamplingParams

CANDIDATES = 2  # draws per top-p row and step: none in the nucleus with probability <= (1 - top_p)^2
ROUNDS = 8  # further rounds of CANDIDATES draws before the sorted nucleus
SUB = 64  # tokens per sub-block when looking for the k-th largest weight


class RowWeights:
    """The sampling weights of N rows and what drawing from them needs.

    Masks multiply by a float 0/1 scratch row (`torch.ge(..., out=float)`): on a CPU a
    bool mask with `masked_fill_` / `where` took ~2.5 ms over 16 x 49,152, the float
    compare and multiply ~0.35 ms."""

    def __init__(self, logits: torch.Tensor, params: list[SamplingParams], workspace: Workspace | None = None) -> None:
        """logits: [N, V] any float dtype (bfloat16 is read as is: the float32 weights come out
        of one converting copy, no other float32 copy of the logits). Greedy rows get weights
        at temperature 1 (the caller takes their argmax instead). The weights live in
        `workspace` (a fresh one when None) until it is next used."""
        n, vocab = logits.shape
        device = logits.device
        self.params, self.device = params, device
        self.workspace = workspace if workspace is not None else Workspace()
        buf, w = self.workspace.weights(n, vocab, device)
        w.copy_(logits)  # [N, V] float32
        w.sub_(w.amax(dim=-1, keepdim=True))  # <= 0, the row's maximum at 0
        inv_t = [1.0 if p.greedy else 1.0 / p.temperature for p in params]
        if any(t != 1.0 for t in inv_t):
            w.mul_(torch.tensor(inv_t, dtype=torch.float32, device=device)[:, None])
        w.exp_()  # the row's softmax x a constant; its maximum is 1
        if any(p.top_k > 0 for p in params):
            self._zero_below(w, _kth_largest(buf, vocab, params))
        self.has_top_p = [p.top_p < 1.0 and not p.greedy for p in params]
        top_p = torch.tensor([p.top_p if t else float("inf") for p, t in zip(params, self.has_top_p, strict=True)],
                             dtype=torch.float64, device=device)
        self.nucleus_mass: torch.Tensor | None = None  # [N] float64: top_p x weight after top-k
        min_p = [p.min_p for p in params]
        if any(self.has_top_p) and any(min_p):
            self.nucleus_mass = top_p * w.sum(dim=-1).to(torch.float64)  # before min-p
        if any(min_p):
            self._zero_below(w, torch.tensor(min_p, dtype=torch.float32, device=device)[:, None])
        self.w = w
        self.cdf = BlockCDF(buf)
        if any(self.has_top_p) and self.nucleus_mass is None:
            self.nucleus_mass = top_p * self.cdf.total

    def _zero_below(self, w: torch.Tensor, thresh: torch.Tensor) -> None:
        """w [N, V] *= (w >= thresh [N, 1])."""
        w.mul_(torch.ge(w, thresh, out=self._scratch(*w.shape)))

    def _scratch(self, rows: int, vocab: int) -> torch.Tensor:
        """A float32 [rows, vocab] scratch tensor (masks, nucleus tests)."""
        return self.workspace.get("scratch", rows, vocab, self.device)

    def draw(self, generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row: ([N] int64 ids, [N] bool rows whose draws all fell outside the
        nucleus, or None when no row has a nucleus). Those rows' ids are not valid yet: the
        caller passes them to `resolve_nucleus` once it has read the flags (with the step's
        ids, in one device -> host transfer)."""
        counts = [0 if p.greedy else CANDIDATES if t else 1 for p, t in zip(self.params, self.has_top_p, strict=True)]
        device = self.device
        cand = self.cdf.search(uniforms(generators, counts, device))  # [N, R]
        if self.nucleus_mass is None:
            return cand[:, 0], None
        top_p_rows = [i for i, t in enumerate(self.has_top_p) if t]
        ok = torch.ones_like(cand, dtype=torch.bool)  # [N, R]
        if device.type == "cpu":
            # Host syncs are free here: test a later draw only where the earlier ones failed
            # (one pass over the vocabulary a step instead of CANDIDATES). The same draws win.
            pending = top_p_rows
            for j in range(CANDIDATES):
                rows = torch.tensor(pending)
                inside = self._in_nucleus(cand[rows, j : j + 1], rows)[:, 0]
                ok[rows, j] = inside
                pending = [r for r, i in zip(pending, inside.tolist(), strict=True) if not i]
                if not pending:
                    break
        else:
            rows = torch.tensor(top_p_rows, device=device)
            ok[rows] = self._in_nucleus(cand[rows], rows)
        first = ok.to(torch.uint8).argmax(dim=-1, keepdim=True)  # the first draw inside
        return cand.gather(1, first).squeeze(1), ~ok.any(dim=-1)

    def resolve_nucleus(self, row: int, generator: torch.Generator | None) -> int:
        """The token of a top-p row whose step draws all fell outside its nucleus: more rounds
        of draws, then the sorted nucleus. Either way what it returns follows the nucleus
        distribution (a rejection sampler may stop after any number of rounds into an exact
        draw). Rare: probability <= (1 - top_p)^CANDIDATES a row and step."""
        rows = torch.tensor([row], device=self.device)
        for _ in range(ROUNDS):
            u = uniforms([generator], [CANDIDATES], self.device)
            cand = self.cdf.search(u, rows)  # [1, R]
            ok = self._in_nucleus(cand, rows)[0].tolist()
            if any(ok):
                return int(cand[0, ok.index(True)])
        return self._draw_sorted_nucleus(row, generator)

    def _in_nucleus(self, cand: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """cand [M, R] token ids of rows `rows` [M] -> [M, R] bool: inside the row's nucleus."""
        assert self.nucleus_mass is not None
        w = self.w[rows] if len(rows) < self.w.shape[0] else self.w  # [M, V]
        cand_w = w.gather(1, cand)  # [M, R]
        above = torch.empty(cand.shape, dtype=torch.float64, device=w.device)  # [M, R]
        scratch = self._scratch(*w.shape)
        for j in range(cand.shape[1]):  # the weight of the strictly more likely tokens
            above[:, j] = torch.gt(w, cand_w[:, j, None], out=scratch).mul_(w).sum(dim=-1)
        return above < self.nucleus_mass[rows][:, None]

    def _draw_sorted_nucleus(self, row: int, generator: torch.Generator | None) -> int:
        """One draw from the row's nucleus found by sorting it (the same membership rule)."""
        assert self.nucleus_mass is not None
        w = self.w[row]  # [V]
        desc = w.sort(descending=True).values.to(torch.float64)
        before = desc.cumsum(0) - desc  # weight of the tokens sorted before each
        last = int((before < self.nucleus_mass[row]).sum()) - 1  # >= 0: before[0] = 0
        kept = torch.where(w >= desc[last].to(w.dtype), w, 0.0).to(torch.float64)
        cum = kept.cumsum(0)
        u = uniforms([generator], [1], w.device)[0]
        pos = int(torch.searchsorted(cum, u * cum[-1], right=True))
        return min(pos, int(torch.nonzero(kept).max()))


def _kth_largest(buf: torch.Tensor, vocab: int, params: list[SamplingParams]) -> torch.Tensor:
    """[N, 1]: each row's k-th largest weight (0 for rows without top-k, which keeps all).

    buf [N, V'] (V' >= V, padded with zeros). Not a sort, not even `topk` over the row (1.2 ms
    for 16 x 49,152 on a CPU): the k largest values lie in the k sub-blocks of `SUB` tokens
    with the largest maxima (any value outside them is <= the k-th of those maxima, and the
    k maxima are values of the union), so `topk` runs over those k x SUB values only.
    """
    n, width = buf.shape
    ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    kmax = max(ks)
    if kmax * SUB < width and width % SUB == 0:
        sub = buf.view(n, width // SUB, SUB)  # [N, B', SUB]
        best = sub.amax(dim=-1).topk(kmax, dim=-1).indices  # [N, kmax]
        buf = sub.gather(1, best[..., None].expand(-1, -1, SUB)).view(n, kmax * SUB)
    top = buf.topk(kmax, dim=-1).values  # [N, kmax], descending
    ix = torch.tensor([max(k, 1) - 1 for k in ks], device=buf.device)
    kth = top.gather(1, ix[:, None])
    none = torch.tensor([float(k == 0) for k in ks], device=buf.device)[:, None]
    return kth * (1.0 - none)
