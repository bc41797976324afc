"""Top-k rows sampled among their candidates (engine/sample/top_k.py; issue 38, item 1).

The candidates are the k + 16 sub-blocks of 64 tokens with the largest maxima, so these tests
use vocabularies of more than (k + 16) x 64 tokens: the sub-block selection, the padded last
block and the tie check all run. Chi-square fits against `apply_top_k_top_p_min_p` + softmax (equal
to HF's processors: tests/test_sampler_reference.py), as tests/test_sampler_chisquare.py does.
"""

from __future__ import annotations

import pytest
import torch
from test_sampler_chisquare import ALPHA, biased, chi2_pvalue, draw, logits_row, reference_probs

from engine.sample.row_weights import RowWeights
from engine.sample.sampler import Sampler, SamplingBatch, greedy
from engine.sample.top_k import TopKCandidates
from engine.sampling_params import SamplingParams

VOCAB = 4000  # 63 sub-blocks, the last one 32 tokens long


def _tied_row(spread: bool) -> torch.Tensor:
    """[VOCAB] logits: 5.0, 4.0, then 24 tokens at 3.0 (the 3rd largest) over a tail < 0.

    spread: the ties in 24 sub-blocks (with top_k=3 they reach past the 3 + 16 candidate
    sub-blocks), else in one sub-block (all among the candidates)."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 0.5 - 4.0
    row[10], row[200] = 5.0, 4.0
    row[torch.arange(24) * 150 + 300 if spread else torch.arange(24) + 320] = 3.0
    return row


CASES = [
    SamplingParams(top_k=8, temperature=0.9),
    SamplingParams(top_k=20, top_p=0.7, temperature=1.1),  # the nucleus cuts inside the k
    SamplingParams(top_k=12, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=5, top_p=0.5, temperature=2.0),  # top-p over ties, a flat head
    SamplingParams(top_k=10, top_p=0.98, temperature=1.5),  # the k cuts first
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}-t{p.temperature}")
def test_top_k_draws_fit_the_reference_distribution(params: SamplingParams) -> None:
    row = logits_row(VOCAB, seed=21)
    row[row.topk(6).indices[3:]] = row.topk(6).values[3]  # a tie inside the head
    probs = reference_probs(row, params)
    ids = draw(row, params, seed=13)
    assert chi2_pvalue(ids, probs) > ALPHA
    assert chi2_pvalue(ids, biased(probs)) < ALPHA  # the test sees a 2% bias


@pytest.mark.parametrize("spread", [False, True], ids=["ties-inside", "ties-past-the-candidates"])
def test_ties_at_the_kth_value_are_all_kept(spread: bool) -> None:
    """HF keeps every token equal to the k-th largest: when they reach past the candidates
    the row is flagged and sampled over its vocabulary, with the same law either way."""
    row = _tied_row(spread)
    params = SamplingParams(top_k=3, top_p=0.99)  # no cut inside the ties (HF's cut there is by its sort)
    _, overflow = TopKCandidates(row[None], [params]).draw([None])
    assert bool(overflow[0]) == spread
    probs = reference_probs(row, params)
    assert int((probs > 0).sum()) == 26
    ids = draw(row, params, seed=17)
    assert chi2_pvalue(ids, probs) > ALPHA
    assert chi2_pvalue(ids, biased(probs)) < ALPHA


def test_bfloat16_logits_with_many_ties() -> None:
    """bfloat16 logits tie often near the k-th value (8 bits of mantissa)."""
    g = torch.Generator().manual_seed(5)
    row = (torch.randn(4096, generator=g) * 3).to(torch.bfloat16)
    params = SamplingParams(top_k=40, top_p=0.9, temperature=0.5)
    probs = reference_probs(row.float(), params)
    ids = draw(row, params, seed=19)
    assert chi2_pvalue(ids, probs) > ALPHA


def test_a_uniform_picks_the_token_the_vocabulary_search_picks() -> None:
    """Top-k alone: the candidates are searched in token-id order, as the full-vocabulary
    path searches, so a seed draws the same tokens as before the candidates path."""
    rows = 300
    logits = logits_row(VOCAB, seed=4)[None].expand(rows, -1).contiguous()
    params = [SamplingParams(top_k=10, temperature=1.3)] * rows

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(s) for s in range(rows)]

    fast, overflow = TopKCandidates(logits, params).draw(gens())
    full, _ = RowWeights(logits, params).draw(gens())
    assert not bool(overflow.any())
    assert torch.equal(fast, full)
    assert len(set(fast.tolist())) == 10


def test_a_mixed_batch_keeps_each_row_its_own_law() -> None:
    """Greedy, top-k (one whose ties reach past its candidates), top-p and plain rows in one
    batch: greedy rows take the argmax, each sampled row stays inside its kept set, and a
    seeded top-k row draws the same tokens alone as among the others."""
    tied = _tied_row(spread=True)
    other = logits_row(VOCAB, seed=8)
    logits = torch.stack([other, tied, other, other, tied])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, seed=1),
        SamplingParams(top_k=6, top_p=0.8, seed=2),
        SamplingParams(top_p=0.5),
        SamplingParams(top_k=3, top_p=0.9, min_p=0.3),
    ]
    kept = [
        set(torch.nonzero(reference_probs(logits[i], p)).flatten().tolist())
        for i, p in enumerate(params[1:], 1)
    ]
    sampler = Sampler()
    g_mixed, g_alone = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(60):
        gens = [None, torch.Generator().manual_seed(1), g_mixed, None, None]
        ids, _ = sampler.sample(logits, SamplingBatch(params, gens))
        alone, _ = sampler.sample(logits[2:3], SamplingBatch(params[2:3], [g_alone]))
        assert ids[0] == int(greedy(logits[:1])[0])
        assert ids[2] == alone[0]
        for i, token in enumerate(ids[1:], 1):
            assert token in kept[i - 1], (i, token)
            seen[i].add(token)
    assert len(seen[2]) > 1 and len(seen[4]) > 1  # they really sampled
