"""A step's StepStats row (steps.csv), from the runner's output and the scheduler's counters.

Two shapes of step: a synchronous one (schedule, execute, update in one call: `step_stats`) and
one of the async batch queue (`async_step_stats`), whose scheduler counters were taken when it
was scheduled and whose state columns (running, waiting, KV blocks) are those after its update.

A step's members (`step_members`): each scheduled request with its tokens, its kind (prefill,
decode, recompute after a preemption), its tokens in KV before the step and its prefix hit; taken
right after `schedule()`, while the requests' state is the step's own (SLO attribution reads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.core.sched.stats import SchedulerStats
from engine.request import Request
from engine.seam import FinishReason, StepMember, StepStats
from engine.step_io import ModelRunnerOutput, SchedulerOutput

# The scheduler's state columns: after the update that a row reports.
STATE_COLUMNS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "kv_blocks_used_per_group")


def comm_stats(runner_out: ModelRunnerOutput) -> dict[str, Any]:
    """StepStats' communication columns from a step's per-collective seconds."""
    times = runner_out.comm_times
    return {
        "comm_time": sum(times.values()),
        "all_reduce_time": times.get("all_reduce", 0.0),
        "dispatch_time": times.get("dispatch", 0.0),
        "combine_time": times.get("combine", 0.0),
    }


def runner_columns(runner_out: ModelRunnerOutput) -> dict[str, Any]:
    """The columns the model runner measured: its phases, compile status, padding, collectives."""
    return {
        "prepare_time": runner_out.prepare_time,
        "forward_time": runner_out.forward_time,
        "sample_time": runner_out.sample_time,
        "compiled": runner_out.compiled,
        "padded_tokens": runner_out.padded_tokens,
        **comm_stats(runner_out),
    }


def step_members(so: SchedulerOutput, requests: Mapping[str, Request]) -> list[StepMember]:
    """The requests `so` schedules, in batch order; call right after `schedule()` (`requests` is
    the scheduler's, before the step's update changes them).

    `num_computed` comes from `so` (the scheduler has already advanced the requests' own count).
    Decode: one token (drafts aside), the prompt already computed and the token the last known
    one, as placeholders of async scheduling allow. Recompute: a request back from preemption, on
    its first step after resuming (whatever it computes) and on every step until it decodes."""
    new = {d.req_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True)) | new
    drafts = so.scheduled_spec_decode_tokens
    members = []
    for rid, n in so.num_scheduled_tokens.items():
        computed = before.get(rid, 0)
        req = requests.get(rid)
        resumed = req is not None and req.num_preemptions > 0
        if req is None:
            kind = "prefill"
        elif resumed and rid in new:
            kind = "recompute"  # its first step back, even when the prefix cache kept all but one token
        elif (n - len(drafts.get(rid, ())) == 1 and computed >= req.num_prompt_tokens
              and computed + 1 >= req.num_tokens):
            kind = "decode"
        else:
            kind = "recompute" if resumed else "prefill"
        members.append(StepMember(rid, n, kind, computed, new.get(rid, 0)))
    return members


def step_stats(step: int, now: float, runner_out: ModelRunnerOutput, sched: SchedulerStats, *,
               schedule_time: float, update_time: float, step_time: float,
               members: list[StepMember] | None = None) -> StepStats:
    """A synchronous step: `sched` is the scheduler's counters and state after its update;
    `members` its requests (`step_members`)."""
    return StepStats(step=step, time=now, schedule_time=schedule_time, update_time=update_time,
                     step_time=step_time, batch_queue_depth=1, members=members or [],
                     **runner_columns(runner_out), **sched.as_dict())


def async_step_stats(step: int, scheduled: SchedulerStats, state: SchedulerStats, now: float,
                     runner_out: ModelRunnerOutput, outputs: list[Any], *, schedule_time: float,
                     update_time: float, depth: int, members: list[StepMember] | None = None) -> StepStats:
    """A step of the batch queue: the counters of its schedule() (`scheduled`), the state after its
    update (`state`), `num_finished` from the outputs it delivered, `depth` steps in flight."""
    values = scheduled.as_dict()
    for key in STATE_COLUMNS:
        values[key] = getattr(state, key)
    values["num_finished"] = sum(1 for o in outputs if o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH))
    return StepStats(step=step, time=now, schedule_time=schedule_time, update_time=update_time,
                     batch_queue_depth=depth, members=members or [], **runner_columns(runner_out), **values)
