"""Arrival processes and length distributions: seeded statistics and exact definitions."""

from pathlib import Path

import numpy as np
import pytest

from workloads.arrivals import (
    closed_loop_arrivals,
    constant_arrivals,
    gamma_arrivals,
    interarrival_cv,
    make_arrivals,
    mark_warmup,
    poisson_arrivals,
    ramp_arrivals,
)
from workloads.lengths import Empirical, Fixed, LogNormal, Normal, Uniform, make_lengths
from workloads.spec import RequestSpec

ARXIV = Path(__file__).resolve().parents[1] / "../shared/traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
N = 20_000


def test_poisson_mean_gap_cv_and_vllm_rescale():
    t = poisson_arrivals(N, 10.0, np.random.default_rng(0))
    assert np.all(np.diff(t) >= 0)
    assert t[-1] == pytest.approx(N / 10.0, rel=1e-12)  # last arrival at N/r
    assert np.diff(t).mean() == pytest.approx(0.1, rel=0.02)
    assert interarrival_cv(t) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize(("b", "cv"), [(0.25, 2.0), (1.0, 1.0), (4.0, 0.5)])
def test_gamma_burstiness_sets_cv(b, cv):
    # Gamma(shape=b) gaps have CV 1/sqrt(b); rescaling does not change the CV
    t = gamma_arrivals(N, 5.0, b, np.random.default_rng(1))
    assert interarrival_cv(t) == pytest.approx(cv, rel=0.05)
    assert t[-1] == pytest.approx(N / 5.0)


def test_gamma_without_rescale_keeps_raw_draws():
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    raw = gamma_arrivals(100, 2.0, 0.5, rng_a, rescale=False)
    expected = np.cumsum(rng_b.gamma(shape=0.5, scale=1.0 / (2.0 * 0.5), size=100))
    np.testing.assert_allclose(raw, expected)


def test_same_seed_same_arrivals():
    a = make_arrivals("gamma", 50, np.random.default_rng(7), rate=3.0, burstiness=0.5)
    b = make_arrivals("gamma", 50, np.random.default_rng(7), rate=3.0, burstiness=0.5)
    np.testing.assert_array_equal(a, b)


def test_constant_ramp_and_closed():
    np.testing.assert_allclose(constant_arrivals(4, 2.0), [0.5, 1.0, 1.5, 2.0])
    t = ramp_arrivals(5, 1.0, 5.0)  # rates 1, 2, 3, 4, 5
    np.testing.assert_allclose(np.diff(np.concatenate([[0.0], t])), [1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    np.testing.assert_array_equal(closed_loop_arrivals(3), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="rate"):
        constant_arrivals(3, 0.0)


def test_random_ramp_speeds_up():
    t = ramp_arrivals(N, 1.0, 20.0, np.random.default_rng(0), burstiness=1.0)
    gaps = np.diff(t)
    assert gaps[: N // 10].mean() > 5 * gaps[-N // 10 :].mean()


def test_mark_warmup_flags_first_w():
    specs = [RequestSpec(f"r{i}", float(i), "x", None, 1, 1) for i in range(5)]
    mark_warmup(specs, 2)
    assert [s.is_warmup for s in specs] == [True, True, False, False, False]


def test_length_distributions_seeded_and_clamped():
    rng = np.random.default_rng(0)
    assert Fixed(7).sample(3, rng).tolist() == [7, 7, 7]
    u = Uniform(10, 20).sample(N, rng)
    assert u.min() == 10 and u.max() == 20
    n = Normal(100, 10, min_len=95, max_len=105).sample(N, rng)
    assert n.min() == 95 and n.max() == 105
    ln = LogNormal(200, 0.5).sample(N, rng)
    assert np.median(ln) == pytest.approx(200, rel=0.03)
    a = make_lengths("normal", mean=50, std=5).sample(10, np.random.default_rng(5))
    b = make_lengths("normal", mean=50, std=5).sample(10, np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="unknown"):
        make_lengths("zipf")


@pytest.mark.skipif(not ARXIV.exists(), reason="no ../shared/traces")
def test_empirical_from_arxiv_csv():
    dist = Empirical.from_csv(ARXIV, "num_decode_tokens", max_len=300)
    assert len(dist.values) == 28_257
    s = dist.sample(5000, np.random.default_rng(0))
    assert s.max() <= 300 and s.min() >= 1
    assert set(s.tolist()) <= {min(v, 300) for v in dist.values}
