"""Capacity search on a synthetic latency curve with a known knee, and replica counts."""

from __future__ import annotations

import pytest

from workloads.rate_search import SLO, find_max_rate, replicas_for_rate


def _queue_like(rate: float) -> dict[str, float]:
    """p99 TTFT of an M/M/1-like server with capacity 10 req/s: 100 ms / (1 - rate/10)."""
    load = min(rate / 10.0, 0.999999)
    return {"p99_ttft_ms": 100.0 / (1.0 - load), "completed_fraction": 1.0 if rate < 10 else 0.5}


def test_finds_the_knee_within_tolerance() -> None:
    # 100 / (1 - r/10) <= 400  <=>  r <= 7.5.
    result = find_max_rate(_queue_like, SLO(max={"p99_ttft_ms": 400.0}), start=1.0, rel_tol=0.01)
    assert 7.5 / 1.01 <= result.max_rate <= 7.5
    assert result.best is not None and result.best.rate == result.max_rate
    rates = [e.rate for e in result.evaluations]
    assert rates[:4] == [1.0, 2.0, 4.0, 8.0]  # doubling while passing
    assert not result.evaluations[3].ok and "p99_ttft_ms" in result.evaluations[3].violations[0]


def test_halves_down_when_the_start_rate_fails() -> None:
    result = find_max_rate(_queue_like, SLO(max={"p99_ttft_ms": 200.0}), start=100.0, rel_tol=0.02)
    assert 5.0 / 1.02 <= result.max_rate <= 5.0  # 100 / (1 - r/10) <= 200  <=>  r <= 5


def test_min_limits_rate_cap_and_budget() -> None:
    slo = SLO(min={"completed_fraction": 0.99})
    capped = find_max_rate(_queue_like, slo, start=1.0, rate_limit=3.0)
    assert capped.max_rate == 3.0 and len(capped.evaluations) == 3  # 1, 2, 3: never failed
    budget = find_max_rate(_queue_like, SLO(max={"p99_ttft_ms": 500.0}), max_evals=3)
    assert len(budget.evaluations) == 3 and budget.max_rate == 4.0
    never = find_max_rate(lambda r: {"p99_ttft_ms": 1e9}, SLO(max={"p99_ttft_ms": 1.0}), max_evals=5)
    assert never.max_rate == 0.0 and never.best is None


def test_missing_summary_key_is_an_error() -> None:
    with pytest.raises(KeyError, match="p99_tpot_ms"):
        find_max_rate(_queue_like, SLO(max={"p99_tpot_ms": 50.0}))


def test_replicas_for_rate() -> None:
    assert replicas_for_rate(20.0, 8.0) == 3
    assert replicas_for_rate(16.0, 8.0) == 2
    assert replicas_for_rate(0.5, 8.0) == 1
    with pytest.raises(ValueError):
        replicas_for_rate(1.0, 0.0)
