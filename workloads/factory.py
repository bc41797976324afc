"""Build a workload (a sorted list of RequestSpec) from the `workload` config section.

Synthetic workloads draw lengths and arrivals from the configured distributions;
trace workloads load a trace, slice and time-scale it, fit its lengths to the
model's context, and synthesize prompts (Mooncake hash ids become shared token
blocks). What was done to a trace is returned so the run can record it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from workloads.arrivals import make_arrivals, mark_warmup
from workloads.lengths import LengthDist, make_lengths
from workloads.prompts import PromptBuilder
from workloads.sessions import SessionShape, session_workload
from workloads.spec import RequestSpec, sort_workload
from workloads.synthetic import SharedPrefix, synthetic_workload
from workloads.trace_workload import trace_workload
from workloads.traces import fit_to_context, load_trace, scale_time, slice_rows

ROOT = Path(__file__).resolve().parents[1]


def resolve_path(path: str) -> Path:
    """Relative paths are tried from the working directory, then from the project root."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    alt = ROOT / p
    return alt if alt.exists() else p


def length_dist(cfg: Any) -> LengthDist:
    kind = cfg.dist
    if kind == "fixed":
        return make_lengths("fixed", value=int(cfg.value))
    if kind == "uniform":
        return make_lengths("uniform", low=int(cfg.low), high=int(cfg.high))
    if kind == "normal":
        return make_lengths(kind, mean=float(cfg.mean), std=float(cfg.std), min_len=int(cfg.min_len),
                            max_len=cfg.max_len)
    if kind == "lognormal":
        # mean/std are of the lengths themselves: sigma^2 = ln(1 + (std/mean)^2), median = mean / sqrt(1 + cv^2)
        mean, std = float(cfg.mean), float(cfg.std)
        if mean <= 0 or std < 0:
            raise ValueError(f"workload length: lognormal needs mean > 0 and std >= 0, got {mean}, {std}")
        var_log = math.log1p((std / mean) ** 2)
        return make_lengths(kind, median=mean / math.sqrt(1 + (std / mean) ** 2), sigma=math.sqrt(var_log),
                            min_len=int(cfg.min_len), max_len=cfg.max_len)
    if kind == "empirical":
        if not cfg.path or not cfg.column:
            raise ValueError("workload length: empirical needs `path` and `column`")
        path = resolve_path(cfg.path)
        if not path.exists():
            raise ValueError(f"workload length: no such file {cfg.path}")
        return make_lengths("empirical", path=path, column=cfg.column, min_len=int(cfg.min_len),
                            max_len=cfg.max_len)
    raise ValueError(f"workload length: unknown dist {kind!r} (fixed|uniform|normal|lognormal|empirical)")


def build_workload(cfg: Any, tokenizer: Any, max_model_len: int) -> tuple[list[RequestSpec], dict[str, Any]]:
    """(specs sorted by arrival, extra facts to record in the run config)."""
    rng = np.random.default_rng(int(cfg.seed))
    builder = PromptBuilder(tokenizer)
    if cfg.kind == "trace":
        specs, info = _trace(cfg, builder, rng, max_model_len)
    elif cfg.kind == "synthetic":
        specs, info = _synthetic(cfg, builder, rng, max_model_len), {}
    else:
        raise ValueError(f"workload.kind: unknown {cfg.kind!r} (synthetic|trace)")
    for s in specs:
        s.ignore_eos = bool(cfg.ignore_eos)
    salt = resolve_salt(str(getattr(cfg, "prompt_salt", "") or ""))
    if salt:
        salt_prompts(specs, salt, builder)
        info = {**info, "prompt_salt": salt}
    specs = sort_workload(specs)
    mark_warmup(specs, int(cfg.warmup_requests))
    return specs, info


def plan_workload(cfg: Any, tokenizer: Any, max_len: int, run_dir: Path) -> tuple[list[RequestSpec], dict[str, Any]]:
    """A run's requests (`cfg`: its RunConfig; replayed when `cfg.replay`), recorded in
    <run_dir>/workload.jsonl."""
    from workloads.replay import replayed, write_workload

    specs, extra = build_workload(cfg.workload, tokenizer, max_len)
    if cfg.replay:
        specs = replayed(specs, cfg.replay)
        extra = {**(extra or {}), "replay_of": str(cfg.replay)}
    write_workload(run_dir, specs)
    return specs, extra


def resolve_salt(setting: str) -> str:
    """`workload.prompt_salt`: "" none, "auto" a new random salt per run, else the text itself."""
    if setting == "auto":
        import secrets

        return f"[run {secrets.token_hex(4)}] "
    return setting


def salt_prompts(specs: list[RequestSpec], salt: str, builder: PromptBuilder) -> None:
    """Start every prompt with `salt`, so a long-lived server's prefix cache cannot answer this
    run from an earlier run's identical prompts (prefixes shared within the run stay shared).
    `prompt_len` grows by the salt's tokens (text prompts: re-counted whole)."""
    salt_ids = builder.encode(salt)
    for spec in specs:
        if spec.prompt_token_ids is not None:
            spec.prompt_token_ids = salt_ids + list(spec.prompt_token_ids)
            spec.prompt_len = len(spec.prompt_token_ids)
        elif isinstance(spec.prompt, str):
            spec.prompt = salt + spec.prompt
            spec.prompt_len = len(builder.encode(spec.prompt))


def _synthetic(cfg: Any, builder: PromptBuilder, rng: np.random.Generator, max_model_len: int) -> list[RequestSpec]:
    n = int(cfg.num_requests)
    if n < 1:
        raise ValueError("workload.num_requests must be >= 1")
    arr = cfg.arrival
    times = make_arrivals(arr.process, n, rng, rate=float(arr.rate), burstiness=float(arr.burstiness),
                          rate_end=arr.rate_end)
    prompt_lens, output_lens = length_dist(cfg.prompt_len), length_dist(cfg.output_len)
    if cfg.multi_turn.num_sessions > 0:
        mt = cfg.multi_turn
        shape = SessionShape(
            num_turns=int(mt.turns), first_prompt=prompt_lens, message=make_lengths("fixed", value=int(mt.message_len)),
            output=output_lens, as_token_ids=bool(cfg.prompt_as_token_ids),
        )
        starts = make_arrivals(arr.process, int(mt.num_sessions), rng, rate=float(arr.rate),
                               burstiness=float(arr.burstiness), rate_end=arr.rate_end)
        return session_workload(builder, starts, shape, rng)
    sp = cfg.shared_prefix
    shared = SharedPrefix(int(sp.num_groups), int(sp.prefix_len), float(sp.fraction)) if sp.num_groups > 0 else None
    specs = synthetic_workload(builder, times, prompt_lens, output_lens, rng,
                               as_token_ids=bool(cfg.prompt_as_token_ids), shared_prefix=shared)
    for s in specs:
        if s.prompt_len + s.max_tokens > max_model_len:
            raise ValueError(
                f"workload: a request of {s.prompt_len} + {s.max_tokens} tokens exceeds the model context "
                f"({max_model_len}); lower the length distributions"
            )
    return specs


def _trace(cfg: Any, builder: PromptBuilder, rng: np.random.Generator, max_model_len: int):
    t = cfg.trace
    if not t.path:
        raise ValueError("workload.trace.path is required for kind=trace")
    path = resolve_path(t.path)
    if not path.exists():
        raise ValueError(f"workload.trace.path: no such file {t.path} (see ../shared/traces/README.md)")
    rows, info = load_trace(path, t.format)
    first_n = t.max_requests if t.max_requests is not None else int(cfg.num_requests)
    rows = slice_rows(rows, first_n=first_n, start_s=t.start_s, end_s=t.end_s, info=info)
    if t.time_scale != 1.0:
        rows = scale_time(rows, float(t.time_scale), info=info)
    if t.max_output_tokens is not None:
        cap = int(t.max_output_tokens)
        rows = [replace(r, output_tokens=min(r.output_tokens, cap)) for r in rows]
    if info.format == "mooncake" or any(r.hash_ids for r in rows):
        info.block_size = int(t.block_size)  # the tokens each hash id names
    if t.lengths != "none":
        rows = fit_to_context(rows, max_model_len, t.lengths, info=info, block_multiple=int(t.block_multiple))
    block = int(info.block_size)
    specs = trace_workload(rows, builder, rng, block_size=block, as_token_ids=True)
    return specs, {"trace": info.to_dict()}
