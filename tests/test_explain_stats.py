"""servelab-explain's error rate on identical code, on synthetic reps (no engine, seeded).

A clean-clone CI run named `forward › linears` beyond noise for identical code: fifteen
components, each with its own 95% interval over 3 pairs. The contributors' intervals are now
simultaneous (Bonferroni over the family); these experiments draw both sides of every pair from
the same distribution, with per-rep machine noise, and count how often anything is named.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from analysis.explain import explain

GROUPS = ("attention", "linears", "mlp", "norm", "embedding", "lm head / logits", "rope", "sampler ops")
PHASES = {"schedule": 0.4, "prepare": 0.8, "sample": 1.2, "update": 0.3, "other": 0.2}  # ms per step
OP_MS = 2.0  # ms per step of each operator group


def _rep(rng: np.random.Generator, tokens: list[int]) -> dict[str, Any]:
    """One rep of 12 steps of fixed sizes; every component carries a per-rep factor (the machine's
    state during the rep, 4% sd) and per-step noise (5% sd)."""
    factor = {name: rng.normal(1.0, 0.04) for name in (*PHASES, *GROUPS, "host", "idle")}
    steps, wall = [], 0.0
    for n in tokens:
        ops = {f"{g}|op": (OP_MS * (1 + n / 64) * factor[g] * rng.normal(1.0, 0.05), 1) for g in GROUPS}
        step: dict[str, Any] = {p: 1e-3 * ms * factor[p] * rng.normal(1.0, 0.05) for p, ms in PHASES.items()}
        host_ms = 1.5 * factor["host"] * rng.normal(1.0, 0.05)
        step["forward"] = 1e-3 * (sum(ms for ms, _ in ops.values()) + host_ms)
        step |= {"ops": ops, "tokens": n, "requests": 4, "prefill_tokens": max(n - 4, 0), "preemptions": 0,
                 "prefix_hits": 0}  # fmt: skip
        wall += step["forward"] + sum(step[p] for p in PHASES)
        steps.append(step)
    return {"wall_s": wall + 1e-3 * factor["idle"], "output_tokens": 4 * len(tokens), "steps": steps}


def _named_rate(alpha: float, experiments: int = 500, pairs: int = 3) -> float:
    """The share of identical-code experiments in which explain names any contributor."""
    rng = np.random.default_rng(20261205)
    tokens = [64, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    named = 0
    for _ in range(experiments):
        base = [_rep(rng, tokens) for _ in range(pairs)]
        cand = [_rep(rng, tokens) for _ in range(pairs)]
        named += bool(explain(base, cand, min_effect=0.0, alpha=alpha)["contributors"])
    return named / experiments


def test_identical_code_names_nothing_at_the_family_rate() -> None:
    # 500 experiments: the binomial sd at 5% is 1 point; Bonferroni sits at or under alpha (4.7% in 1,000)
    assert _named_rate(0.05) <= 0.075


def test_separate_intervals_would_name_something_most_of_the_time() -> None:
    """What the family-wise level fixes: alpha = 0.05 x the family's size is a separate 95% interval
    per component, and identical code then names something in most experiments."""
    report = explain(*[[_rep(np.random.default_rng(k), [8] * 12) for k in range(s, s + 3)] for s in (0, 3)])
    assert report["components"] == len(PHASES) + len(GROUPS) + 3  # + host, composition, idle
    assert report["component_confidence"] == 1 - 0.05 / report["components"]
    assert _named_rate(0.05 * report["components"], experiments=100) >= 0.3


def test_a_real_change_is_still_named_at_five_pairs() -> None:
    """One group 50% slower (+5% of the time per token) on the candidate, five pairs: named, and nothing else beyond noise."""
    rng = np.random.default_rng(7)
    tokens = [64, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    base = [_rep(rng, tokens) for _ in range(5)]
    cand = [_rep(rng, tokens) for _ in range(5)]
    for rep in cand:
        for s in rep["steps"]:
            ms, calls = s["ops"]["mlp|op"]
            s["ops"]["mlp|op"] = (1.5 * ms, calls)
            s["forward"] += 0.5e-3 * ms
            rep["wall_s"] += 0.5e-3 * ms
    report = explain(base, cand)
    assert [e["component"] for e in report["contributors"]] == ["forward › mlp"], report["contributors"]


def test_the_rep_format_names_agree_with_the_probe() -> None:
    """The probe imports only torch (a baseline tree loads it by path), so it keeps its own copy
    of the rep's phase names and host group; they must be the ones the decomposition reads."""
    from analysis import explain as decomposition
    from workloads import explain_probe

    assert tuple(explain_probe.PHASE_FIELDS) == decomposition.STEP_PHASES
    assert explain_probe.HOST_GROUP == decomposition.HOST_GROUP
