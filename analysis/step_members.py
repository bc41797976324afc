"""step_members.csv: which requests each engine step ran, and how many of their tokens.

One row per (step, request): `step`, `request_id`, `num_tokens` (scheduled that step, drafts
included), `kind` (prefill / decode / recompute, engine/outputs.py `StepMember`), `num_computed`
(its tokens in KV before the step) and `num_prefix_hit` (tokens its admission found cached).
Written for targets whose steps come from this engine in this process (in-process, offline,
simulated); HTTP targets have no such file and SLO attribution falls back (analysis/attribution.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from engine.seam import StepStats

MEMBERS_FILE = "step_members.csv"
MEMBER_COLUMNS = ["step", "request_id", "num_tokens", "kind", "num_computed", "num_prefix_hit"]


def members_frame(steps: Sequence[StepStats]) -> pd.DataFrame:
    """Every step's members, long form (empty, with the columns, when no step has any)."""
    rows = [(s.step, m.request_id, m.num_tokens, m.kind, m.num_computed, m.num_prefix_hit)
            for s in steps for m in s.members]  # fmt: skip
    return pd.DataFrame(rows, columns=MEMBER_COLUMNS)


def write_members(run_dir: str | Path, frame: pd.DataFrame) -> Path | None:
    """step_members.csv in `run_dir`; nothing when `frame` is empty (no member was recorded)."""
    if frame.empty:
        return None
    path = Path(run_dir) / MEMBERS_FILE
    frame.to_csv(path, index=False)
    return path


def read_members(run_dir: str | Path) -> pd.DataFrame | None:
    """The run's step members, or None when the run folder has none (HTTP targets, older runs)."""
    path = Path(run_dir) / MEMBERS_FILE
    if not path.exists():
        return None
    return pd.read_csv(path, dtype={"request_id": str, "kind": str})
