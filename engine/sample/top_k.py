"""Top-k rows draw among their candidates, not over the vocabulary.

A row with top-k (k small) can only draw a token whose logit is >= its k-th largest (ties at
the k-th value are kept, as HF keeps them). Those tokens lie in the k sub-blocks of `SUB`
tokens with the largest maxima (a token outside them is <= the (k+1)-th largest maximum,
and when that maximum is below the k-th largest logit no kept token is left outside), or in
a few more sub-blocks for ties (below). So a
top-k row reads its vocabulary once (the sub-block maxima) and does everything else on
about k x SUB candidates: the k-th value, top-p, min-p, and the inverse-CDF draw.

- top-p after top-k keeps a subset of the top k, so it is decided exactly here, with no
  rejection: token t is in the nucleus iff the weight of the tokens strictly more likely
  than t is below top_p x the weight after top-k (engine/sample/row_weights.py's rule:
  equal logits are kept or dropped together). Those tokens are all among the k largest, so
  a k x k comparison decides it; the kept set is then every candidate >= a threshold logit.
- min-p keeps the weights >= min_p (weights are exp((x - max x) / T), the largest 1): the
  logits >= max x + T ln(min_p). With top-k and top-p, one threshold logit a row.
- The draw: one uniform a row, searched in the cumulative weights of the candidates in
  token-id order (the chosen sub-blocks are sorted by index), the order the full-vocabulary
  search uses, so a uniform picks the same token either way (up to float rounding), and
  the result does not depend on how a device's `topk` orders equal values.

Ties at the k-th value are common in bfloat16 (8 bits of mantissa: of 16 rows x 49,152
Gaussian logits, sd 3, 7 had a token equal to the 50th largest outside the 50 sub-blocks of
the largest maxima, 10 at k = 20; none with 4 more sub-blocks). So a row takes k +
`TIE_SLACK` sub-blocks: every sub-block whose maximum is >= the k-th value is among them
unless more than k + TIE_SLACK tokens are >= it. A row where that happens (the next
sub-block maximum is still >= the k-th value) is flagged: the caller samples it over the
whole vocabulary instead (engine/sample/row_weights.py).
"""

from __future__ import annotations

import math

import torch

from engine.sample.inverse_cdf import Workspace, uniforms
from engine.sampling_params import SamplingParams

SUB = 64  # tokens per sub-block
TIE_SLACK = 16  # sub-blocks taken past the k, for tokens equal to the k-th value
MAX_K = 256  # a larger top-k samples over the whole vocabulary (its candidates would be k x SUB)


def takes_top_k_path(p: SamplingParams) -> bool:
    """Whether a request's row samples among its top-k candidates (`TopKCandidates`)."""
    return not p.greedy and 0 < p.top_k <= MAX_K


class TopKCandidates:
    """The candidates of N top-k rows and their sampling weights."""

    def __init__(
        self, logits: torch.Tensor, params: list[SamplingParams], workspace: Workspace | None = None
    ) -> None:
        """logits: [N, V] any float dtype, one row per request of `params`, each of which
        `takes_top_k_path`. Reads the logits once (one float32 copy into `workspace` unless
        they are float32 already and V is a multiple of SUB)."""
        n, vocab = logits.shape
        device = logits.device
        self.params, self.device = params, device
        ks = [min(p.top_k, vocab) for p in params]
        kmax = max(ks)
        blocks = -(-vocab // SUB)
        if logits.dtype == torch.float32 and logits.is_contiguous() and vocab == blocks * SUB:
            rows = logits
        else:
            ws = workspace if workspace is not None else Workspace()
            rows = ws.get("top_k_logits", n, blocks * SUB, device)
            rows[:, :vocab].copy_(logits)
            rows[:, vocab:].fill_(float("-inf"))  # padding is never kept (weight 0)
        sub = rows.view(n, blocks, SUB)  # [N, B, SUB]

        taken = kmax + TIE_SLACK  # sub-blocks per row
        if blocks > taken:
            maxima = sub.amax(dim=-1)  # [N, B]: the one pass over the vocabulary
            best = maxima.topk(taken + 1, dim=-1)  # [N, taken + 1]
            chosen = best.indices[:, :taken].sort(dim=-1).values  # [N, taken], in token-id order
            next_max = best.values[:, taken:]  # [N, 1]: bounds every token left out
        else:  # every sub-block is a candidate
            chosen = torch.arange(blocks, device=device).expand(n, blocks)
            next_max = None
        offsets = torch.arange(SUB, device=device)
        self.ids = (chosen[..., None] * SUB + offsets).view(n, -1)  # [N, C] token ids, ascending
        cand = rows.gather(1, self.ids)  # [N, C] float32 logits

        top = cand.topk(kmax, dim=-1).values  # [N, kmax] the k largest logits, descending
        kth = top.gather(1, torch.tensor(ks, device=device)[:, None] - 1)  # [N, 1]
        # A tie at the k-th value may continue outside the candidates (-inf tokens weigh 0).
        self.overflow = (
            torch.zeros(n, dtype=torch.bool, device=device)
            if next_max is None
            else ((next_max >= kth) & (next_max > float("-inf")))[:, 0]
        )

        # Weights exp((x - max x) / T) in float32 (as row_weights.py), summed in float64. The
        # exponent is clamped at -80 before exp: float32 exp is ~100x slower where the result
        # would be denormal or 0, and such a token's weight (<= 2e-35 of the largest) is noise
        # to any sum; the masks below zero what is outside the kept set.
        temps = [p.temperature for p in params]
        inv_t = torch.tensor([[1.0 / t] for t in temps], dtype=torch.float32, device=device)
        peak = top[:, :1]  # [N, 1]
        w = cand - peak  # [N, C]
        if any(t != 1.0 for t in temps):
            w.mul_(inv_t)
        w.clamp_(min=-80.0).exp_()  # 1 at the largest
        # Top-k, top-p and min-p each keep the candidates >= a logit: one threshold a row
        # (never below the lowest finite float: -inf logits stay out).
        keep = kth.clamp(min=torch.finfo(torch.float32).min).to(torch.float64)  # [N, 1]
        top_p = [p.top_p for p in params]
        if any(q < 1.0 for q in top_p):
            after_k = (w * (cand >= keep)).sum(dim=-1, keepdim=True, dtype=torch.float64)
            keep = torch.maximum(keep, _nucleus_cut(top, peak, inv_t, ks, top_p, after_k))
        min_p = [p.min_p for p in params]
        if any(min_p):
            # w >= min_p <=> x >= max x + T ln(min_p) (min_p 0: -inf).
            log_min_p = torch.tensor(
                [[t * math.log(m) if m > 0 else -math.inf] for t, m in zip(temps, min_p, strict=True)],
                dtype=torch.float64,
                device=device,
            )
            keep = torch.maximum(keep, peak.to(torch.float64) + log_min_p)
        w.mul_(cand >= keep)
        self.w = w  # [N, C] float32

    def draw(self, generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """One uniform a row -> ([N] int64 token ids, [N] bool `overflow`: those rows' ids are
        not valid; the caller samples them over the whole vocabulary)."""
        u = uniforms(generators, [1] * len(self.params), self.device)  # [N, 1] float64
        cum = self.w.cumsum(dim=-1, dtype=torch.float64)  # [N, C]
        total = cum[:, -1:]
        # The first token whose cumulative weight exceeds the target has a positive weight;
        # a target rounded onto the total is moved just below it (onto the last such token).
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        pos = torch.searchsorted(cum, target, right=True)  # [N, 1]
        return self.ids.gather(1, pos)[:, 0], self.overflow


def _nucleus_cut(
    top: torch.Tensor,
    peak: torch.Tensor,
    inv_t: torch.Tensor,
    ks: list[int],
    top_p: list[float],
    total: torch.Tensor,
) -> torch.Tensor:
    """[N, 1] float64: the smallest logit in each row's nucleus (rows without top-p: -inf).

    top [N, K] float32 the K largest logits (descending), of which row i keeps its first
    ks[i]; peak [N, 1] the largest; inv_t [N, 1] 1 / temperature; total [N, 1] float64 the
    row's weight after top-k. Every token strictly more likely than a kept one is among
    those ks[i], so their K x K comparison gives each one's nucleus test."""
    n, kmax = top.shape
    device = top.device
    w = ((top - peak) * inv_t).clamp_(min=-80.0).exp_()  # [N, K], computed as the candidates'
    w = w.to(torch.float64)
    in_k = torch.arange(kmax, device=device) < torch.tensor(ks, device=device)[:, None]  # [N, K]
    w = w * in_k
    above = (w[:, None, :] * (w[:, None, :] > w[:, :, None])).sum(dim=-1)  # [N, K]
    mass = torch.tensor(top_p, dtype=torch.float64, device=device)[:, None] * total  # [N, 1]
    inside = (above < mass) & in_k  # an upper set of the logits: the nucleus's first ones
    last = inside.sum(dim=-1, keepdim=True) - 1  # >= 0: the largest is always inside
    cut = top.gather(1, last).to(torch.float64)
    no_top_p = torch.tensor([q >= 1.0 for q in top_p], device=device)[:, None]
    return cut.masked_fill(no_top_p, -math.inf)
