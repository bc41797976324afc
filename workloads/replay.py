"""Replay a recorded run's traffic: `servelab-run replay=RUN_DIR`.

Every run folder gets `workload.jsonl`: one line per request the workload planned, with its
planned arrival time, its prompt exactly as sent (token ids when the workload used them, else
the text) and its sampling settings (max_tokens, ignore_eos, temperature 0, priority). A replay
takes the recorded run's `workload` section from its config.yaml (so multi-turn follow-ups are
built the same way), then puts back each recorded request's arrival, prompt and sampling
settings from `workload.jsonl`; the engine, target and everything else come from the new
command line. A run folder without `workload.jsonl` (older runs) is rebuilt from its config
alone: the same seed gives the same prompts, and requests.csv's `scheduled_s` the arrivals.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import OmegaConf

from workloads.spec import RequestSpec

WORKLOAD_FILE = "workload.jsonl"


def write_workload(run_dir: str | Path, specs: list[RequestSpec]) -> Path:
    """<run_dir>/workload.jsonl: what was planned, one JSON object per request."""
    path = Path(run_dir) / WORKLOAD_FILE
    with path.open("w", encoding="utf-8") as f:
        for s in specs:
            row = {"request_id": s.request_id, "arrival_s": s.arrival_s, "prompt_len": s.prompt_len,
                   "prompt_token_ids": s.prompt_token_ids,
                   "prompt": s.prompt if s.prompt_token_ids is None else None,
                   "max_tokens": s.max_tokens, "ignore_eos": s.ignore_eos, "temperature": 0.0,
                   "priority": s.priority, "is_warmup": s.is_warmup, "group": s.group,
                   "session_id": s.session_id, "turn": s.turn}
            f.write(json.dumps(row) + "\n")
    return path


def read_workload(run_dir: str | Path) -> dict[str, dict[str, Any]] | None:
    path = Path(run_dir) / WORKLOAD_FILE
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["request_id"]: r for r in rows}


def check_run_dir(run_dir: str | Path) -> Path:
    """The recorded run folder, or ValueError with one line saying what is missing."""
    path = Path(run_dir).expanduser()
    if not (path / "config.yaml").exists():
        raise ValueError(f"replay: {path} is not a run folder (no config.yaml)")
    return path


def recorded_workload(run_dir: str | Path, section_type: type) -> Any:
    """The recorded run's `workload` section, typed as `section_type` (conf.schema.WorkloadSection)."""
    data = yaml.safe_load((check_run_dir(run_dir) / "config.yaml").read_text()) or {}
    merged = OmegaConf.merge(OmegaConf.structured(section_type), data.get("workload") or {})
    return OmegaConf.to_object(merged)


def replayed(specs: list[RequestSpec], run_dir: str | Path) -> list[RequestSpec]:
    """`specs` (rebuilt from the recorded config) with the recorded arrivals, prompts and
    sampling settings put back; requests the recording does not know keep their rebuilt values."""
    rows = read_workload(run_dir)
    if rows is None:
        return _arrivals_from_requests(specs, Path(run_dir))
    out = []
    for s in specs:
        r = rows.get(s.request_id)
        if r is None:
            out.append(s)
            continue
        ids = r.get("prompt_token_ids")
        out.append(replace(s, arrival_s=float(r["arrival_s"]), prompt_token_ids=ids,
                           prompt=None if ids is not None else r.get("prompt"),
                           max_tokens=int(r["max_tokens"]), ignore_eos=bool(r["ignore_eos"]),
                           priority=int(r.get("priority", 0))))
    return out


def _arrivals_from_requests(specs: list[RequestSpec], run_dir: Path) -> list[RequestSpec]:
    path = run_dir / "requests.csv"
    if not path.exists():
        return specs
    df = pd.read_csv(path, dtype={"request_id": str})
    planned = dict(zip(df["request_id"], df["scheduled_s"], strict=True))
    return [replace(s, arrival_s=float(planned[s.request_id])) if s.request_id in planned and s.turn == 0 else s
            for s in specs]
