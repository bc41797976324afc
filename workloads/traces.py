"""Real request traces: loading, time scaling, slicing, fitting lengths, statistics.

Formats (see ../shared/traces/README.md):
- Azure CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP has 7 fractional digits
  (100 ns), truncated to 6 before parsing.
- Mooncake JSONL `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`; each hash id
  names a 512-token prefix block (chained: equal ids at the same position = shared prefix).
- BurstGPT CSV `Timestamp,Model,Request tokens,Response tokens,...` (whole seconds;
  `Response tokens == 0` marks a failed request, dropped unless keep_failed).
- Our JSONL: one object per line with `timestamp_s`, `prompt_tokens`, `output_tokens` and
  optional `prompt` (text), `hash_ids` (list[int]) and `group` (str).

Every loader returns `list[TraceRow]` sorted by time, with times rebased so the first row is
at 0. Transforms return new lists and add what they did to a `TraceInfo`, which the run
stores in its config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

MOONCAKE_BLOCK = 512


@dataclass(slots=True)
class TraceRow:
    timestamp_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: list[int] | None = None
    prompt: str | None = None
    group: str = ""
    failed: bool = False


@dataclass
class TraceInfo:
    """What was read and what was done to it (stored in the run's config)."""

    path: str
    format: str
    rows_read: int
    rows_used: int = 0
    block_size: int = MOONCAKE_BLOCK
    time_scale: float = 1.0  # replay at k x the recorded rate
    slice: dict[str, float | int | None] = field(default_factory=dict)
    length_mode: str = "none"  # none | clamp | scale
    length_scale: float = 1.0
    max_context: int | None = None
    num_clamped: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _rebase(rows: list[TraceRow]) -> list[TraceRow]:
    rows = sorted(rows, key=lambda r: r.timestamp_s)
    if rows:
        t0 = rows[0].timestamp_s
        for r in rows:
            r.timestamp_s -= t0
    return rows


def load_azure(path: str | Path) -> list[TraceRow]:
    df = pd.read_csv(path, dtype={"TIMESTAMP": str})
    # "2023-11-16 18:15:46.6805900": 7 fractional digits -> keep 6 (microseconds)
    stamps = df["TIMESTAMP"].str.slice(0, 26)
    ts = pd.to_datetime(stamps, format="%Y-%m-%d %H:%M:%S.%f")
    secs = (ts - ts.min()).dt.total_seconds().to_numpy()
    p, o = df["ContextTokens"].to_numpy(), df["GeneratedTokens"].to_numpy()
    return _rebase([TraceRow(float(t), int(a), int(b)) for t, a, b in zip(secs, p, o, strict=True)])


def _json_lines(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load_mooncake(path: str | Path) -> list[TraceRow]:
    return _rebase([
        TraceRow(d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"]),
                 hash_ids=list(d.get("hash_ids") or []))
        for d in _json_lines(path)
    ])


def load_burstgpt(path: str | Path, keep_failed: bool = False) -> list[TraceRow]:
    df = pd.read_csv(path)
    rows = [
        TraceRow(float(t), int(p), int(o), group=str(m), failed=int(o) == 0)
        for t, m, p, o in zip(df["Timestamp"], df["Model"], df["Request tokens"], df["Response tokens"], strict=True)
    ]
    return _rebase([r for r in rows if keep_failed or not r.failed])


def load_jsonl(path: str | Path) -> list[TraceRow]:
    return _rebase([
        TraceRow(float(d["timestamp_s"]), int(d["prompt_tokens"]), int(d["output_tokens"]),
                 hash_ids=d.get("hash_ids"), prompt=d.get("prompt"), group=str(d.get("group", "")))
        for d in _json_lines(path)
    ])


def detect_format(path: str | Path) -> str:
    """azure | mooncake | burstgpt | jsonl, from the file's first line."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if first.startswith("TIMESTAMP"):
        return "azure"
    if first.startswith("Timestamp"):
        return "burstgpt"
    if first.lstrip().startswith("{"):
        return "mooncake" if "input_length" in first else "jsonl"
    raise ValueError(f"{path}: unknown trace format (first line {first[:60]!r})")


_LOADERS = {"azure": load_azure, "mooncake": load_mooncake, "burstgpt": load_burstgpt, "jsonl": load_jsonl}


def load_trace(path: str | Path, fmt: str = "auto") -> tuple[list[TraceRow], TraceInfo]:
    """Read a trace; `fmt` in auto|azure|mooncake|burstgpt|jsonl."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    rows = _LOADERS[fmt](path)
    return rows, TraceInfo(path=str(path), format=fmt, rows_read=len(rows), rows_used=len(rows))


def scale_time(rows: list[TraceRow], k: float, info: TraceInfo | None = None) -> list[TraceRow]:
    """Replay at k times the recorded rate (timestamps divided by k)."""
    if k <= 0:
        raise ValueError("time scale must be > 0")
    if info is not None:
        info.time_scale *= k
    return [replace(r, timestamp_s=r.timestamp_s / k) for r in rows]


def slice_rows(
    rows: list[TraceRow], first_n: int | None = None, start_s: float | None = None,
    end_s: float | None = None, info: TraceInfo | None = None,
) -> list[TraceRow]:
    """Rows with start_s <= t < end_s, then the first `first_n`; times rebased to 0."""
    out = [
        replace(r) for r in rows
        if (start_s is None or r.timestamp_s >= start_s) and (end_s is None or r.timestamp_s < end_s)
    ]
    out = _rebase(out[:first_n] if first_n is not None else out)
    if info is not None:
        info.slice = {"first_n": first_n, "start_s": start_s, "end_s": end_s}
        info.rows_used = len(out)
    return out


def fit_to_context(
    rows: list[TraceRow], max_context: int, mode: str = "clamp", scale: float | None = None,
    info: TraceInfo | None = None, block_multiple: int = 1,
) -> list[TraceRow]:
    """Make every prompt + output fit `max_context` tokens.

    clamp: prompt cut to max_context - 1 and output to what the context leaves (>= 1).
    scale: prompt lengths multiplied by `scale` (default: max_context / longest prompt+output),
    then clamped as above; the prefix block size scales with them (recorded in `info.block_size`)
    so hash-id prefix structure is kept. Outputs are only clamped. With `block_multiple` > 1
    and a trace block size in `info`, the factor is rounded down so that the scaled block is a
    multiple of it (the engine's KV block size): a shared hash block then fills whole KV blocks.
    """
    if mode not in ("clamp", "scale"):
        raise ValueError("mode must be clamp or scale")
    factor = 1.0
    if mode == "scale":
        longest = max((r.prompt_tokens + r.output_tokens for r in rows), default=1)
        factor = scale if scale is not None else min(1.0, max_context / longest)
        if block_multiple > 1 and info is not None and any(r.hash_ids for r in rows):
            scaled_block = max(block_multiple, int(info.block_size * factor) // block_multiple * block_multiple)
            factor = scaled_block / info.block_size
    out, clamped = [], 0
    for r in rows:
        p = max(1, math.ceil(r.prompt_tokens * factor))
        p2 = min(p, max_context - 1)
        o = max(1, min(r.output_tokens, max_context - p2))
        clamped += int(p2 != p or o != r.output_tokens)
        out.append(replace(r, prompt_tokens=p2, output_tokens=o))
    if info is not None:
        info.length_mode, info.length_scale, info.max_context = mode, factor, max_context
        info.num_clamped = clamped
        info.block_size = max(1, round(info.block_size * factor))
    return out


def trace_summary(rows: list[TraceRow]) -> dict[str, float]:
    """rows, span_min, rate (rows / span), interarrival_cv, prompt_p50/p99, output_p50/max."""
    ts = np.array([r.timestamp_s for r in rows], dtype=np.float64)
    p = np.array([r.prompt_tokens for r in rows], dtype=np.float64)
    o = np.array([r.output_tokens for r in rows], dtype=np.float64)
    span = float(ts.max() - ts.min()) if len(ts) else 0.0
    gaps = np.diff(np.sort(ts))
    return {
        "rows": len(rows),
        "span_min": span / 60.0,
        "rate": len(rows) / span if span > 0 else 0.0,
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else 0.0,
        "prompt_p50": float(np.percentile(p, 50)),
        "prompt_p99": float(np.percentile(p, 99)),
        "output_p50": float(np.percentile(o, 50)),
        "output_max": float(o.max()),
    }


def mooncake_block_reuse(rows: list[TraceRow], block_size: int = MOONCAKE_BLOCK) -> float:
    """Fraction of prompt tokens an unbounded prefix cache would serve.

    Walk the rows in time order; a row's leading blocks whose hash ids were seen before are
    hits (hash ids are chained, so a hit block implies its whole prefix is cached), stopping
    at the first miss; the last block may be partial. Then all its blocks become cached.
    """
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        ids = r.hash_ids or []
        total += r.prompt_tokens
        for i, h in enumerate(ids):
            if h not in seen:
                break
            hit += max(0, min(block_size, r.prompt_tokens - i * block_size))
        seen.update(ids)
    return hit / total if total else 0.0


def block_repeat_fraction(rows: list[TraceRow]) -> float:
    """Fraction of all hash-id blocks that repeat a block seen earlier in the trace."""
    seen: set[int] = set()
    rep = n = 0
    for r in rows:
        for h in r.hash_ids or []:
            rep += h in seen
            n += 1
            seen.add(h)
    return rep / n if n else 0.0
