"""The inverse-CDF sampler draws from the reference distribution (issue 38, item 1).

Chi-square goodness of fit of 20,000 draws against the probabilities of
`apply_top_k_top_p_min_p` + softmax (itself equal to HF's processors:
tests/test_sampler_reference.py). Seeds are fixed, so each test is deterministic; cells with
an expected count under 5 are merged into one. A p-value under 1e-3 fails: each test also
checks that the same draws against a reference with 2% of the mass moved between two
likely tokens do fail, so the test has the power to see a biased sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sample import row_weights
from engine.sample.sampler import Sampler, SamplingBatch, apply_top_k_top_p_min_p
from engine.sampling_params import SamplingParams

DRAWS = 20_000
ALPHA = 1e-3


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] float64: the distribution HF's processors give this row."""
    scaled = row[None].double() / p.temperature
    return torch.softmax(apply_top_k_top_p_min_p(scaled, [p]), dim=-1)[0]


def draw(row: torch.Tensor, p: SamplingParams, seed: int) -> np.ndarray:
    """DRAWS tokens from `row`, one batch row each, under a fixed global seed."""
    torch.manual_seed(seed)
    batch = SamplingBatch([p] * DRAWS, [None] * DRAWS)
    ids, _ = Sampler().sample(row[None].expand(DRAWS, -1).contiguous(), batch)
    return np.asarray(ids)


def chi2_pvalue(ids: np.ndarray, probs: torch.Tensor) -> float:
    """p-value of the counts of `ids` against `probs`; a token of probability 0 drawn -> 0."""
    probs_np = probs.numpy()
    counts = np.bincount(ids, minlength=probs_np.size).astype(np.float64)
    if counts[probs_np == 0].sum() > 0:
        return 0.0
    expected = probs_np * ids.size
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def biased(probs: torch.Tensor, shift: float = 0.02) -> torch.Tensor:
    """probs with `shift` of mass moved from the most to the second most likely token."""
    out = probs.clone()
    top2 = probs.topk(2).indices
    out[top2[0]] -= shift
    out[top2[1]] += shift
    return out


def logits_row(vocab: int, seed: int) -> torch.Tensor:
    """[V] float32: a peaked head of 40 tokens spread over the vocabulary, a long flat tail."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=g) - 4.0
    head = torch.randperm(vocab, generator=g)[:40]
    row[head] = torch.randn(40, generator=g) * 1.5 + 2.0
    return row


CASES = [
    (64, SamplingParams(temperature=1.0)),
    (64, SamplingParams(temperature=0.7, min_p=0.05)),
    (64, SamplingParams(top_p=0.8)),
    (64, SamplingParams(top_k=10)),
    (64, SamplingParams(top_k=30, top_p=0.9, min_p=0.01, temperature=1.2)),
    (1000, SamplingParams(temperature=1.0)),  # several search blocks, a padded last one
    (1000, SamplingParams(top_p=0.95)),
    (1000, SamplingParams(top_k=50)),  # the sub-block search for the k-th weight
]


@pytest.mark.parametrize(("vocab", "params"), CASES, ids=lambda c: str(c) if isinstance(c, int) else
                         f"t{c.temperature}-k{c.top_k}-p{c.top_p}-m{c.min_p}")
def test_draws_fit_the_reference_distribution(vocab: int, params: SamplingParams) -> None:
    row = logits_row(vocab, seed=vocab)
    probs = reference_probs(row, params)
    ids = draw(row, params, seed=7)
    assert chi2_pvalue(ids, probs) > ALPHA
    assert chi2_pvalue(ids, biased(probs)) < ALPHA  # the test sees a 2% bias


def test_bfloat16_logits_sample_their_own_distribution() -> None:
    """The runner passes the LM head's bfloat16 logits: they are read as they are."""
    row = logits_row(64, seed=3).to(torch.bfloat16)
    params = SamplingParams(top_p=0.9)
    probs = reference_probs(row.float(), params)
    assert chi2_pvalue(draw(row, params, seed=11), probs) > ALPHA


@pytest.mark.parametrize("rounds", [row_weights.ROUNDS, 0])
def test_rows_outside_the_nucleus_are_finished_exactly(rounds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """top_p 0.3 over a flat row: most draws fall outside the nucleus, so the later rounds
    (and, with no rounds left, the sorted nucleus) decide the token; still the same law."""
    monkeypatch.setattr(row_weights, "ROUNDS", rounds)
    row = torch.linspace(0.0, 2.0, 64)
    params = SamplingParams(top_p=0.3)
    probs = reference_probs(row, params)
    ids = draw(row, params, seed=5)
    assert chi2_pvalue(ids, probs) > ALPHA
    assert chi2_pvalue(ids, biased(probs, 0.02)) < ALPHA


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_top_p_rows_repeat_alone_and_among_neighbours() -> None:
    """A seeded low-top-p row (often finished by later rounds) draws the same tokens alone,
    again, and between unseeded and other seeded rows: its generator advances by its own
    draws only."""
    logits = torch.stack([torch.linspace(0.0, 2.0, 64), logits_row(64, 1), torch.linspace(2.0, 0.0, 64)])
    target = SamplingParams(top_p=0.3, seed=42)
    others = [SamplingParams(temperature=1.0), SamplingParams(top_p=0.2, seed=9)]
    sampler = Sampler()

    def run(batched: bool) -> list[int]:
        gens = [_gen(42), None, _gen(9)]
        tokens = []
        for _ in range(30):
            if batched:
                ids, _ = sampler.sample(logits, SamplingBatch([target, *others], gens))
            else:
                ids, _ = sampler.sample(logits[:1], SamplingBatch([target], gens[:1]))
            tokens.append(ids[0])
        return tokens

    alone = run(batched=False)
    assert run(batched=True) == alone == run(batched=False)
    assert len(set(alone)) > 1
