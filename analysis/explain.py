"""What got slower: a change in time per output token, decomposed over profiled repeats.

Design note: "the same code did more work" and "the same work got slower" are told apart with
a cost model fitted on the baseline's own steps. For every component (an engine phase, or an
operator group of the forward phase) a line `ms = a + b * tokens in the step` is fitted over
all baseline steps; a rep's *expected* time of that component is the line summed over the
rep's own steps. Then per output token

    actual = expected (the work: how many steps, how many tokens in each)
           + (actual - expected) (the speed: the same work taking longer)

The work terms of all components add up to one contributor, "composition", named after what
changed in the steps (preemptions, prefix hits, batching); each component's speed term is a
contributor of its own; time outside steps (idle) is one more. The contributors add up to the
measured change exactly. Forward is not a contributor itself: its operator groups are (module
ranges of workloads/explain_probe.py, and the CPU forward plan's part ranges, which carry the same
group names), plus "forward › host", the forward time outside every op.

Intervals: the repeats are run in pairs, alternating which side goes first; one pair is one
independent unit. The change's interval is Student's t over the per-pair differences of the total
(95%). The contributors are a family of about fifteen components tested at once, so their
intervals are simultaneous (Bonferroni): each is Student's t at 1 - alpha / m, m the number of
components, and the chance that identical code names anything is at most `alpha` (default 0.05).
Without it, fifteen separate 95% intervals named a component of identical code in one CI run of
three pairs (`forward › linears` -0.53 ms, interval -1.04 .. -0.02, while the total change's
interval held zero). The price is width: at 3 pairs a component's half-width is 18.4 standard
errors against 4.3 for one 95% interval, at 5 pairs 6.5, at 8 pairs 4.5, so the CLI and the gate
run 5 pairs by default. A contributor is beyond noise when its simultaneous interval excludes zero
and it is at least `min_effect` (default 2%) of the baseline's time per token; the others fold
into one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from analysis.stats import Interval, mean_interval

# A rep's engine phases and the forward group of time outside every op, as
# workloads/explain_probe.py writes them (it keeps its own copy: it imports only torch and the
# standard library; tests/test_explain_stats.py checks that the two agree).
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update")
HOST_GROUP = "host"
PHASES = ("schedule", "prepare", "sample", "update", "other")  # forward: by operator group
IDLE = "idle (outside steps)"
COMPOSITION = "composition"


def _components(step: dict[str, Any]) -> dict[str, float]:
    """A step's ms by component: its phases but forward, forward's operator groups and host."""
    out = {p: 1e3 * step[p] for p in PHASES}
    groups: dict[str, float] = {}
    for key, (ms, _calls) in step["ops"].items():
        group = key.split("|", 1)[0]
        groups[group] = groups.get(group, 0.0) + ms
    for group, ms in groups.items():
        out[f"forward › {group}"] = ms
    out[f"forward › {HOST_GROUP}"] = 1e3 * step["forward"] - sum(groups.values())
    return out


def _fit(reps: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per component, (a, b) of ms = a + b * tokens by least squares over every step of `reps`."""
    steps = [s for r in reps for s in r["steps"]]
    tokens = np.array([s["tokens"] for s in steps], dtype=float)
    x = np.stack([np.ones_like(tokens), tokens], axis=1)  # [steps, 2]
    comps = [_components(s) for s in steps]
    out = {}
    for name in names:
        y = np.array([c.get(name, 0.0) for c in comps])
        if np.ptp(tokens) == 0:  # one step size: the mean per step
            out[name] = (float(y.mean()) if len(y) else 0.0, 0.0)
        else:
            (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
            out[name] = (float(a), float(b))
    return out


def composition(rep: dict[str, Any]) -> dict[str, float]:
    """What the rep's steps did: steps, tokens per step, batch size, prefill share, preemptions, prefix hits."""
    steps = rep["steps"]
    n = max(len(steps), 1)
    tokens = sum(s["tokens"] for s in steps)
    return {
        "steps": float(len(steps)),
        "tokens_per_step": tokens / n,
        "batch_size": sum(s["requests"] for s in steps) / n,
        "prefill_share": sum(s["prefill_tokens"] for s in steps) / max(tokens, 1),
        "preemptions": float(sum(s["preemptions"] for s in steps)),
        "prefix_hits": float(sum(s["prefix_hits"] for s in steps)),
        "output_tokens": float(rep["output_tokens"]),
    }


def decompose_rep(rep: dict[str, Any], model: dict[str, tuple[float, float]]) -> dict[str, float]:
    """One rep's ms per output token: COMPOSITION (expected over all components), each
    component's actual minus expected, IDLE; they add up to the rep's wall time per token."""
    out_tokens = max(rep["output_tokens"], 1)
    actual = dict.fromkeys(model, 0.0)
    expected = dict.fromkeys(model, 0.0)
    step_ms = 0.0
    for s in rep["steps"]:
        comps = _components(s)
        step_ms += sum(comps.values())
        for name, (a, b) in model.items():
            actual[name] += comps.get(name, 0.0)
            expected[name] += a + b * s["tokens"]
    row = {name: (actual[name] - expected[name]) / out_tokens for name in model}
    row[COMPOSITION] = sum(expected.values()) / out_tokens
    row[IDLE] = (1e3 * rep["wall_s"] - step_ms) / out_tokens
    return row


def _ops_per_step(reps: Sequence[dict[str, Any]], group: str) -> dict[str, tuple[float, float]]:
    """{op: (self ms per call, calls per step)} of one forward operator group over `reps`."""
    totals: dict[str, list[float]] = {}
    steps = sum(len(r["steps"]) for r in reps) or 1
    for r in reps:
        for s in r["steps"]:
            for key, (ms, calls) in s["ops"].items():
                g, _, op = key.partition("|")
                if g == group:
                    cell = totals.setdefault(op, [0.0, 0.0])
                    cell[0] += ms
                    cell[1] += calls
    return {op: (ms / max(calls, 1), calls / steps) for op, (ms, calls) in totals.items()}


def _interval(diffs: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean per-pair difference and its Student's t interval at `confidence`. (A percentile
    bootstrap of 3-5 pairs is far too narrow: identical code came out +30% "beyond noise" with
    3 pairs on a loaded machine; at a Bonferroni level it also needs tens of thousands of resamples
    to place its tails.)"""
    values = np.asarray(diffs, dtype=float)
    if len(values) < 2 or np.ptp(values) == 0:
        v = float(values.mean()) if len(values) else 0.0
        return Interval(v, v, v, len(values))
    low, high = mean_interval(values, confidence)
    return Interval(float(values.mean()), low, high, len(values))


def _composition_name(base: dict[str, float], cand: dict[str, float]) -> str:
    for key, label in (("preemptions", "preemptions"), ("prefix_hits", "prefix hits"),
                       ("steps", "steps / batch size"), ("tokens_per_step", "tokens per step")):  # fmt: skip
        if abs(cand[key] - base[key]) > 1e-9:
            return f"{COMPOSITION}: {label} {base[key]:g} → {cand[key]:g}"
    return f"{COMPOSITION} (unchanged)"


def _mean_composition(reps: Sequence[dict[str, Any]]) -> dict[str, float]:
    rows = [composition(r) for r in reps]
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def explain(base: Sequence[dict[str, Any]], cand: Sequence[dict[str, Any]], min_effect: float = 0.02,
            alpha: float = 0.05, same_work: bool = True) -> dict[str, Any]:  # fmt: skip
    """The decomposition of paired reps (`base[i]` and `cand[i]` ran one after the other, from
    workloads/explain_probe.py's `profiled_rep`): a JSON-ready report (module docstring). `same_work`: every rep
    must have produced the same output tokens (the same requests, greedy; a failed step breaks it).
    `alpha`: the family-wise error rate of the contributors' simultaneous intervals."""
    if len(base) != len(cand) or len(base) < 2:
        raise ValueError(f"explain: needs 2 or more paired reps, got {len(base)} and {len(cand)}")
    produced = {r["output_tokens"] for r in (*base, *cand)}
    if same_work and len(produced) != 1:
        raise ValueError(f"explain: the reps produced different output token counts {sorted(produced)} "
                         "(a failed step?): not the same work")
    names = sorted({n for r in (*base, *cand) for s in r["steps"] for n in _components(s)})
    model = _fit(base, names)
    rows_b = [decompose_rep(r, model) for r in base]
    rows_c = [decompose_rep(r, model) for r in cand]
    total_b = [sum(r.values()) for r in rows_b]
    total_c = [sum(r.values()) for r in rows_c]
    change = _interval([c - b for b, c in zip(total_b, total_c, strict=True)])
    base_total = float(np.mean(total_b))
    comp_b, comp_c = _mean_composition(base), _mean_composition(cand)
    contributors, noise = [], {"count": 0, "contribution": 0.0}
    family = [COMPOSITION, *names, IDLE]
    confidence = 1.0 - alpha / len(family)  # Bonferroni: simultaneous over the family
    for name in family:
        iv = _interval([c[name] - b[name] for b, c in zip(rows_b, rows_c, strict=True)], confidence)
        beyond = iv.excludes_zero() and abs(iv.point) >= min_effect * base_total
        entry = {"name": _composition_name(comp_b, comp_c) if name == COMPOSITION else name,
                 "component": name, "contribution": iv.point, "low": iv.low, "high": iv.high,
                 "share": iv.point / change.point if change.point else 0.0, "beyond_noise": beyond}  # fmt: skip
        if name.startswith("forward › "):
            group = name.removeprefix("forward › ")
            ops_b, ops_c = _ops_per_step(base, group), _ops_per_step(cand, group)
            moved = sorted(set(ops_b) | set(ops_c), key=lambda op: -abs(
                np.prod(ops_c.get(op, (0.0, 0.0))) - np.prod(ops_b.get(op, (0.0, 0.0)))))  # fmt: skip
            entry["ops"] = [{"op": op, "base_ms_per_call": ops_b.get(op, (0.0, 0.0))[0],
                             "cand_ms_per_call": ops_c.get(op, (0.0, 0.0))[0],
                             "base_calls_per_step": ops_b.get(op, (0.0, 0.0))[1],
                             "cand_calls_per_step": ops_c.get(op, (0.0, 0.0))[1]} for op in moved[:3]]  # fmt: skip
        if beyond:
            contributors.append(entry)
        else:
            noise["count"] += 1
            noise["contribution"] += iv.point
    contributors.sort(key=lambda e: -abs(e["contribution"]))
    return {
        "unit": "ms per output token", "repeats": len(base), "min_effect": min_effect,
        "alpha": alpha, "components": len(family), "component_confidence": confidence,
        "baseline_ms_per_token": base_total, "candidate_ms_per_token": float(np.mean(total_c)),
        "change": {"point": change.point, "low": change.low, "high": change.high},
        "change_pct": 100.0 * change.point / base_total if base_total else 0.0,
        "contributors": contributors, "noise": noise,
        "composition": {"baseline": comp_b, "candidate": comp_c},
        "phases_per_step_ms": {side: _phase_means(reps) for side, reps in (("baseline", base), ("candidate", cand))},
    }  # fmt: skip


def _phase_means(reps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean ms per step of every engine phase (steps.csv's columns) over the reps."""
    steps = [s for r in reps for s in r["steps"]] or [dict.fromkeys([*STEP_PHASES, "other"], 0.0)]
    return {p: 1e3 * float(np.mean([s[p] for s in steps])) for p in (*STEP_PHASES, "other")}


def format_explain(report: dict[str, Any], top: int = 5) -> str:
    """The console lines: the change, the top contributors with share and interval, the folded rest."""
    ch = report["change"]
    lines = [f"explain: {report['baseline_ms_per_token']:.2f} → {report['candidate_ms_per_token']:.2f} ms per "
             f"output token ({report['change_pct']:+.1f}%; change {ch['point']:+.3f} ms, 95% CI "
             f"{ch['low']:+.3f} .. {ch['high']:+.3f}; {report['repeats']} paired repeats)"]  # fmt: skip
    if "components" in report:
        lines.append(f"explain: contributors' intervals simultaneous over {report['components']} components "
                     f"({1 - report['alpha']:.0%} together, {report['component_confidence']:.2%} each)")  # fmt: skip
    if not report["contributors"]:
        lines.append("explain: no component changed beyond noise")
    for e in report["contributors"][:top]:
        lines.append(f"  {e['share']:>6.0%}  {e['contribution']:+.3f} ms/token ({e['low']:+.3f} .. {e['high']:+.3f})"
                     f"  {e['name']}")  # fmt: skip
        for op in e.get("ops", [])[:2]:
            lines.append(f"          {op['op']}: {op['base_ms_per_call']:.3f} → {op['cand_ms_per_call']:.3f} ms/call, "
                         f"{op['base_calls_per_step']:.1f} → {op['cand_calls_per_step']:.1f} calls/step")  # fmt: skip
    n = report["noise"]
    if n["count"]:
        lines.append(f"  {n['contribution']:+.3f} ms/token from {n['count']} component(s) within noise")
    return "\n".join(lines)
