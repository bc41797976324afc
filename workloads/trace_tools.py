"""Trace analysis and synthesis (what AIPerf's analyze-trace / synthesize-trace do).

`analyze_trace(rows)` measures what a replay of the trace asks of a server:
- lengths: prompt and output token distributions (mean, std, min, p50, p90, p99, max);
- arrivals (workloads/trace_arrivals.py): the mean rate, the rate in windows of `window_s`
  seconds, the gaps' CV and the shape k of a gamma fitted to the positive gaps (k = 1 is
  Poisson, k < 1 burstier, k > 1 more regular), the timestamps' resolution, the batches of
  requests that share a timestamp, the index of dispersion of the counts per window, and
  whether the gamma describes the gaps at all (a trace logged in batches is not a gamma);
- sessions: multi-turn conversations. Rows with a `group` are sessions by group; rows with
  hash ids are chained by prefix: a row continues the latest earlier, not yet continued, row
  whose blocks all but the last (a turn's last block is partial, so the next turn rewrites it)
  it starts with;
- prefix cache: the hit rate an unbounded prefix cache reaches replaying the rows one after
  another at the engine's KV `block_size` (see `prefix_hit_rate`).

`synthesize_trace(rows, n, rate_scale)` draws a new trace from the same structure:
- rows are drawn without replacement (all of them once per full copy, then a random subset),
  in the source's order, so each length pair, session turn order and prefix stays as it was;
- a hash block that only one source row uses is that row's own text: each drawn copy gets a
  fresh id for it; blocks shared by two rows or more keep their ids (the prefix tree stays);
- arrival times follow what describes the source's (`trace_arrivals.synthesize_arrivals`): its
  batches (sizes and gaps) where requests share timestamps, else the fitted gamma where it
  describes the gaps, else the gaps themselves; gaps divided by `rate_scale` (the rate is k
  times the source's, the shape the same).
With n equal to the source's rows, the lengths and the prefix hit rate are the source's
exactly (the hits of chained blocks do not depend on the order: a block hits on every visit
after its first); a different n visits the shared prefixes proportionally less or more often,
as a shorter or longer stretch of the same traffic would.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from workloads.trace_arrivals import arrival_stats, synthesize_arrivals
from workloads.traces import MOONCAKE_BLOCK, TraceRow

PERCENTILES = (50, 90, 99)


def length_stats(values: np.ndarray) -> dict[str, float]:
    """mean, std, min, p50, p90, p99, max of a length column (zeros when empty)."""
    if not len(values):
        return {k: 0.0 for k in ("mean", "std", "min", "p50", "p90", "p99", "max")}
    out = {"mean": float(values.mean()), "std": float(values.std()), "min": float(values.min())}
    out.update({f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES})
    out["max"] = float(values.max())
    return out


def _prefix_ids(r: TraceRow, trace_block: int) -> list[int]:
    """The hash ids that cover the row's prompt (a trace may list more than it uses)."""
    return list(r.hash_ids or [])[: -(-r.prompt_tokens // trace_block)]


def session_ids(rows: list[TraceRow]) -> list[int]:
    """A session number per row (see the module doc); rows in time order."""
    if any(r.group for r in rows):
        names: dict[str, int] = {}
        return [names.setdefault(r.group or f"\0{i}", len(names)) for i, r in enumerate(rows)]
    open_turns: dict[tuple[int, int], list[int]] = {}  # (k, id of block k-1) -> rows ending there
    out: list[int] = []
    sessions = itertools.count()
    for i, r in enumerate(rows):
        ids = r.hash_ids or []
        session = None
        for k in range(len(ids) - 1, 0, -1):  # the longest earlier turn first
            waiting = open_turns.get((k, ids[k - 1]))
            if waiting:
                session = out[waiting.pop()]
                break
        out.append(next(sessions) if session is None else session)
        if len(ids) >= 2:  # (chained ids: the last full block names the whole prefix)
            open_turns.setdefault((len(ids) - 1, ids[len(ids) - 2]), []).append(i)
    return out


def session_stats(rows: list[TraceRow]) -> dict[str, float]:
    """Number of sessions, turns per session (mean, max), share of rows in multi-turn ones."""
    turns = Counter(session_ids(rows))
    sizes = np.array(list(turns.values()) or [0], dtype=np.float64)
    multi = float(sizes[sizes > 1].sum())
    return {
        "sessions": len(turns),
        "turns_mean": float(sizes.mean()),
        "turns_max": float(sizes.max()),
        "multi_turn_row_share": multi / len(rows) if rows else 0.0,
    }


def prefix_hit_rate(rows: list[TraceRow], block_size: int = 16, trace_block: int = MOONCAKE_BLOCK) -> float:
    """Prefix-cache hit tokens / prompt tokens for rows replayed one by one, unbounded cache.

    Follows the engine's KV cache: a prompt is cut into full `block_size` blocks, each hashed
    with its parent's hash (chained); a request hits on its leading blocks already cached,
    at most (prompt_tokens - 1) // block_size of them (the last token is always computed);
    then all its full blocks are cached. Block k's tokens come from trace block
    k * block_size // trace_block (the hash id's text, as trace_workload and
    trace_token_specs build it); tokens past the row's hash ids are the row's own.
    `trace_block` must be a multiple of `block_size`.
    """
    if trace_block % block_size:
        raise ValueError(f"trace block {trace_block} is not a multiple of the KV block size {block_size}")
    per = trace_block // block_size
    cached: set[int] = set()
    hits = queries = 0
    for r in rows:
        ids = _prefix_ids(r, trace_block)
        n_hashed = min(r.prompt_tokens // block_size, len(ids) * per)
        chain, keys = 0, []
        for k in range(n_hashed):
            chain = hash((chain, ids[k // per], k % per))
            keys.append(chain)
        cap = max(0, (r.prompt_tokens - 1) // block_size)
        hit = next((k for k, key in enumerate(keys[:cap]) if key not in cached), min(cap, len(keys)))
        hits += hit * block_size
        queries += r.prompt_tokens
        cached.update(keys)
    return hits / queries if queries else 0.0


def analyze_trace(
    rows: list[TraceRow], *, block_size: int = 16, trace_block: int = MOONCAKE_BLOCK, window_s: float = 60.0
) -> dict[str, Any]:
    """Lengths, arrivals, sessions and prefix reuse of `rows` (time-ordered); see the module doc."""
    ts = np.array([r.timestamp_s for r in rows], dtype=np.float64)
    out: dict[str, Any] = {
        "rows": len(rows),
        "prompt_tokens": length_stats(np.array([r.prompt_tokens for r in rows], dtype=np.float64)),
        "output_tokens": length_stats(np.array([r.output_tokens for r in rows], dtype=np.float64)),
        "arrivals": arrival_stats(ts, window_s),
        "sessions": session_stats(rows),
    }
    if any(r.hash_ids for r in rows):
        out["prefix_cache"] = {
            "block_size": block_size,
            "trace_block_size": trace_block,
            "hit_rate": prefix_hit_rate(rows, block_size, trace_block),
            "hit_rate_at_trace_block": prefix_hit_rate(rows, trace_block, trace_block),
        }
    return out


def _draw_rows(m: int, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(copy, source index) pairs: each source row once per full copy of the source, then a
    random subset without replacement; ordered by source index, copies interleaved."""
    full, rest = divmod(n, m)
    picks = [(c, j) for c in range(full) for j in range(m)]
    picks += [(full, int(j)) for j in rng.choice(m, size=rest, replace=False)]
    return sorted(picks, key=lambda p: (p[1], p[0]))


def synthesize_trace(
    rows: list[TraceRow],
    num_requests: int,
    *,
    rate_scale: float = 1.0,
    seed: int = 0,
    trace_block: int = MOONCAKE_BLOCK,
) -> list[TraceRow]:
    """`num_requests` rows with the source's lengths, sessions and prefix tree, arriving at
    `rate_scale` times its rate with its burstiness (see the module doc)."""
    if not rows or num_requests < 1 or rate_scale <= 0:
        raise ValueError("need source rows, num_requests >= 1 and rate_scale > 0")
    rng = np.random.default_rng(seed)
    ts = np.array([r.timestamp_s for r in rows], dtype=np.float64)
    times = synthesize_arrivals(ts, num_requests, rate_scale, rng)

    visits = Counter(h for r in rows for h in set(_prefix_ids(r, trace_block)))
    fresh = itertools.count(max((h for r in rows for h in r.hash_ids or []), default=-1) + 1)
    out = []
    for t, (copy, j) in zip(times, _draw_rows(len(rows), num_requests, rng), strict=True):
        src = rows[j]
        ids = None
        if src.hash_ids:
            ids = [h if visits[h] > 1 else next(fresh) for h in _prefix_ids(src, trace_block)]
        group = f"{src.group}#{copy}" if src.group else ""
        out.append(TraceRow(float(t), src.prompt_tokens, src.output_tokens, hash_ids=ids, group=group))
    return out


def write_jsonl(rows: list[TraceRow], path: str | Path) -> None:
    """Our JSONL (workloads.traces.load_jsonl reads it back): timestamp_s, prompt_tokens,
    output_tokens, and hash_ids / group where the row has them."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            d: dict[str, Any] = {"timestamp_s": round(r.timestamp_s, 6), "prompt_tokens": r.prompt_tokens,
                                 "output_tokens": r.output_tokens}  # fmt: skip
            if r.hash_ids is not None:
                d["hash_ids"] = r.hash_ids
            if r.group:
                d["group"] = r.group
            f.write(json.dumps(d) + "\n")
