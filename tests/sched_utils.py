"""Helpers to drive the Scheduler without a model (block size 16 unless told).

`fake_runner_output` plays the model runner: every scheduled request that this
step brings level with its known tokens samples one token.
"""

from __future__ import annotations

import itertools

from engine.config import CacheConfig, SchedulerConfig
from engine.core.sched.scheduler import Scheduler
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreOutput
from engine.step_io import ModelRunnerOutput, SchedulerOutput

EOS = 2
SAMPLED = 7  # default token the fake runner samples (never EOS)
_arrivals = itertools.count(1)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    max_model_len: int = 4096,
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    cache_cfg = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(sched_cfg, cache_cfg, num_blocks=num_blocks, max_model_len=max_model_len)


def make_request(
    req_id: str,
    num_prompt_tokens: int | None = None,
    *,
    prompt: list[int] | None = None,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    first_token: int = 100,
    **sampling: object,
) -> Request:
    """A request with prompt `prompt` or `first_token .. first_token + n - 1` (never EOS)."""
    if prompt is None:
        assert num_prompt_tokens is not None
        prompt = list(range(first_token, first_token + num_prompt_tokens))
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(
        req_id,
        prompt,
        params,
        eos_token_id=EOS,
        arrival_time=float(next(_arrivals)) if arrival_time is None else arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


def fake_runner_output(
    scheduler: Scheduler, out: SchedulerOutput, tokens: dict[str, list[int]] | None = None
) -> ModelRunnerOutput:
    """Sample `tokens[req_id]` (default [SAMPLED]) for requests whose input is complete."""
    tokens = tokens or {}
    req_ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        request = scheduler.requests.get(rid)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        req_ids.append(rid)
        sampled.append(list(tokens.get(rid, [SAMPLED])) if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(
    scheduler: Scheduler, tokens: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """schedule() + a fake runner + update_from_output()."""
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, fake_runner_output(scheduler, out, tokens))


def run_until_idle(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    """Step until no request is left; returns every request's streamed tokens."""
    streamed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return streamed
        _, outputs = step(scheduler)
        for o in outputs:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"not idle after {max_steps} steps")
