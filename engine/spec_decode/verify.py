"""Verifying draft tokens against the target model's logits in one forward.

A request with drafts d_1..d_k was scheduled with input tokens [t, d_1, .., d_k]; the
logits at those k + 1 rows give the target distributions p_0..p_k (p_j conditioned on
t, d_1..d_j). Output: the accepted drafts, then one more token (a correction at the first
rejection, or a bonus token from p_k when all are accepted): 1..k+1 tokens.

- Greedy: d_{j+1} is accepted while it equals argmax p_j.
- Sampled: the n-gram draft is a point mass q = δ(d). Rejection sampling accepts d with
  probability min(1, p(d) / q(d)) = p(d); on rejection it samples from the residual
  max(0, p - q) normalized, i.e. p with d removed. The emitted token is then distributed
  exactly as p (Leviathan et al. 2023), so speculation changes speed, not the distribution.
  p here is the processed distribution (temperature, top-k, top-p, min-p), as the plain
  sampler would draw from. Random draws use the request's generator when it is seeded.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sample.sampler import Sampler, SamplingBatch, apply_top_k_top_p_min_p
from engine.sampling_params import SamplingParams
from engine.seam import TokenLogprobs


def logits_layout(cu: np.ndarray, sample_idx: np.ndarray, drafts_of: list[list[int]]) -> np.ndarray:
    """Packed rows whose logits are computed: for sampling request j (ending at packed row
    cu[sample_idx[j]] - 1) its last 1 + len(drafts_of[j]) rows."""
    ends = cu[sample_idx]
    parts = [np.arange(e - 1 - len(d), e) for e, d in zip(ends.tolist(), drafts_of, strict=True)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def sample_with_drafts(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts_of: list[list[int]]
) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
    """logits [sum(1 + k_j), V]: request j's 1 + k_j rows back to back. Requests without
    drafts go through the plain sampler (penalties, logprobs); the others are verified."""
    starts = np.cumsum([0] + [1 + len(d) for d in drafts_of])
    plain = [j for j, d in enumerate(drafts_of) if not d]
    out: list[list[int]] = [[] for _ in drafts_of]
    logprobs: list[TokenLogprobs | None] = [None] * len(drafts_of)
    if plain:
        sub = SamplingBatch(
            params=[batch.params[j] for j in plain],
            generators=[batch.generators[j] for j in plain],
            prompt_ids=[batch.prompt_ids[j] for j in plain] if batch.prompt_ids is not None else None,
            output_ids=[batch.output_ids[j] for j in plain] if batch.output_ids is not None else None,
        )
        ids, lps = sampler.sample(logits[torch.as_tensor(starts[plain])], sub)
        for j, tok, lp in zip(plain, ids, lps, strict=True):
            out[j], logprobs[j] = [tok], lp
    for j, drafts in enumerate(drafts_of):
        if drafts:
            rows = logits[int(starts[j]) : int(starts[j + 1])]
            out[j] = verify_drafts(rows, drafts, batch.params[j], batch.generators[j])
    return out, logprobs


def verify_drafts(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """logits [k + 1, V] for one request -> its accepted drafts plus one token."""
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        return drafts[:accepted] + [target[accepted]]
    probs = target_probs(logits, params).cpu()  # [k + 1, V]
    return rejection_sample(probs, drafts, generator)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the plain sampler draws from, per row: [R, V] float32."""
    scaled = logits.float() / max(params.temperature, 1e-5)
    scaled = apply_top_k_top_p_min_p(scaled, [params] * scaled.shape[0])
    return torch.softmax(scaled, dim=-1)


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """probs [k + 1, V] (CPU) of the target at each draft position -> accepted drafts + one."""
    out: list[int] = []
    uniforms = torch.rand(len(drafts), generator=generator).tolist() if drafts else []
    for j, d in enumerate(drafts):
        p = probs[j]
        if uniforms[j] < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p(d) rounded to 1 but u fell above it
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
