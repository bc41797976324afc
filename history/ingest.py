"""A run folder or a paired gate's gate.json as one `Record` for the store.

- A run folder (`servelab-run`'s): every numeric top-level value of `summary.json`, measured
  at the commit; the config digest is of `config.yaml` less where the run was written
  (`run.output_dir`, `run.name`); a `gate.json` beside it (the stored gate) gives the verdict.
- A paired gate's `gate.json` (`servelab-gate --against`): per metric, the candidate's median
  (at the commit) with the gate's change, interval and verdict, and the baseline's median (at
  the gate's baseline commit, measured in the same run: a second point of that commit). The
  config digest is of the gate's config (conf/gate/paired.yaml unless told otherwise).

The commit is the checkout's HEAD unless one is named (gate.json does not say which commit
the candidate was); a checkout with uncommitted changes is recorded as dirty, and change
detection leaves dirty records out. The same input recorded twice is stored once
(`source_digest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from history.machine import Commit, Machine, branch_of, commit_info, this_machine, versions

# The run folder's own location in its config: not part of what was measured.
RUN_LOCATION_KEYS = ("output_dir", "name")


@dataclass(frozen=True, slots=True)
class Measurement:
    commit: str
    commit_time: float  # committer time of `commit` (orders the series)
    role: str  # "run" | "candidate" | "baseline"
    metric: str
    value: float
    change: float | None = None  # the gate's paired change (candidate role)
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str | None = None
    direction: str | None = None  # "lower" | "higher" is better, where the gate's rules say


@dataclass(frozen=True)
class Record:
    kind: str  # "run" | "gate"
    source_digest: str
    commit: Commit
    machine: Machine
    versions: Mapping[str, str]
    config_digest: str
    config_name: str
    measurements: list[Measurement]
    branch: str = ""
    verdict: str | None = None
    baseline_commit: str | None = None
    source_path: str = ""
    recorded_at: float = field(default_factory=time.time)


def digest(obj: Any, n: int = 16) -> str:
    """Hex digest of `obj`'s canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def is_paired_gate_json(data: Mapping[str, Any]) -> bool:
    return "baseline_commit" in data and "checks" in data and "verdict" in data


def _run_measurements(run_dir: Path, info: Commit) -> tuple[list[Measurement], str | None, dict[str, Any]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    verdicts: dict[str, str] = {}
    verdict = None
    gate = run_dir / "gate.json"
    if gate.is_file():  # the stored-baseline gate's verdict, written into the run folder
        g = json.loads(gate.read_text())
        verdict = g.get("verdict")
        verdicts = {c["metric"]: "REGRESSION" if c.get("regressed") else "ok" for c in g.get("checks", [])}
    ms = []
    for key, raw in sorted(summary.items()):
        value = _number(raw)
        if value is not None:
            ms.append(Measurement(info.sha, info.time, "run", key, value, verdict=verdicts.get(key)))
    return ms, verdict, summary


def _gate_measurements(data: Mapping[str, Any], info: Commit, base: Commit | None) -> list[Measurement]:
    """The candidate's medians at `info`, the baseline's at `base` (None: not in this clone, left out)."""
    ms = []
    for c in data["checks"]:
        rule = c.get("rule") or {}
        interval = c.get("interval") or (None, None)
        cand, basev = _number(c.get("candidate")), _number(c.get("baseline"))
        if cand is not None:
            ms.append(Measurement(info.sha, info.time, "candidate", c["metric"], cand, _number(c.get("change")),
                                  _number(interval[0]), _number(interval[1]), c.get("verdict"),
                                  rule.get("direction")))  # fmt: skip
        if basev is not None and base is not None:
            ms.append(Measurement(base.sha, base.time, "baseline", c["metric"], basev,
                                  direction=rule.get("direction")))
    return ms


def default_gate_config(repo: Path) -> Path:
    """The repo's conf/gate/paired.yaml, else the installed one."""
    local = repo / "conf" / "gate" / "paired.yaml"
    if local.is_file():
        return local
    import conf

    return Path(conf.__file__).parent / "gate" / "paired.yaml"


def load_record(path: Path, repo: Path, commit: str = "HEAD", gate_config: Path | None = None,
                machine: Machine | None = None) -> Record:  # fmt: skip
    """The Record of a run folder or a paired gate's gate.json (module docstring).
    ValueError where `path` is neither."""
    info = commit_info(repo, commit)
    mach, vers, branch, source = machine or this_machine(), versions(), branch_of(repo), str(path)
    if path.is_dir():
        if not (path / "summary.json").is_file():
            raise ValueError(f"{path}: not a run folder (no summary.json)")
        ms, verdict, summary = _run_measurements(path, info)
        cfg_path = path / "config.yaml"
        cfg = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
        run_section = {k: v for k, v in (cfg.get("run") or {}).items() if k not in RUN_LOCATION_KEYS}
        measured = {**cfg, "run": run_section}
        name = str((cfg.get("run") or {}).get("name", ""))
        src = digest(["run", info.sha, info.dirty, summary], 64)
        return Record("run", src, info, mach, vers, digest(measured), name, ms, branch, verdict, source_path=source)
    if not path.is_file():
        raise FileNotFoundError(f"not a run folder or gate.json: {path}")
    data = json.loads(path.read_text())
    if not is_paired_gate_json(data):
        if (path.parent / "summary.json").is_file():
            return load_record(path.parent, repo, commit, gate_config, machine)
        raise ValueError(f"{path}: not a paired gate's gate.json (no baseline_commit/checks/verdict)")
    gcfg_path = gate_config or default_gate_config(repo)
    gcfg = yaml.safe_load(gcfg_path.read_text()) or {}
    try:
        base: Commit | None = commit_info(repo, str(data["baseline_commit"]), check_dirty=False)
    except subprocess.CalledProcessError:
        base = None
    src = digest(["gate", info.sha, info.dirty, data.get("candidate_reps"), data.get("checks")], 64)
    return Record("gate", src, info, mach, vers, digest(gcfg), f"gate:{gcfg.get('experiment', '')}",
                  _gate_measurements(data, info, base), branch, data.get("verdict"), str(data["baseline_commit"]),
                  source)  # fmt: skip
