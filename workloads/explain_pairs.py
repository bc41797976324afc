"""Profiled reps of two in-process engines in pairs, for servelab-explain's decomposition
(analysis/explain.py) without worker processes: the tests' way to explain a change.

Apart from workloads/explain_probe.py, which a baseline tree's gate worker loads by path (a
dataclass there would find no module to belong to).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workloads.explain_probe import profiled_rep


@dataclass
class Side:
    """One side of an in-process explain: an engine, the step hooks to run it with (a test's or
    the gate worker's injected slowdown; None for none) and a context entered around each rep
    (e.g. torch module hooks)."""

    llm: Any
    hooks: Any = None
    around: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext)

    def rep(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        with self.around():
            return profiled_rep(self.llm, requests, self.hooks)


def run_pairs(base: Side, cand: Side, requests: list[dict[str, Any]], repeats: int = 4,
              warmup: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """`repeats` pairs after `warmup` discarded ones, the side that goes first alternating."""
    reps: dict[str, list[dict[str, Any]]] = {"base": [], "cand": []}
    sides = {"base": base, "cand": cand}
    for i in range(warmup + repeats):
        order = ("base", "cand") if i % 2 == 0 else ("cand", "base")
        measured = {name: sides[name].rep(requests) for name in order}
        if i >= warmup:
            for name in order:
                reps[name].append(measured[name])
    return reps["base"], reps["cand"]
