"""A step's StepStats row (steps.csv), from the runner's output and the scheduler's counters.

Two shapes of step: a synchronous one (schedule, execute, update in one call: `step_stats`) and
one of the async batch queue (`async_step_stats`), whose scheduler counters were taken when it
was scheduled and whose state columns (running, waiting, KV blocks) are those after its update.
"""

from __future__ import annotations

from typing import Any

from engine.core.sched.stats import SchedulerStats
from engine.outputs import FinishReason, StepStats
from engine.step_io import ModelRunnerOutput

# The scheduler's state columns: after the update that a row reports.
STATE_COLUMNS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total")


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


def step_stats(step: int, now: float, runner_out: ModelRunnerOutput, sched: SchedulerStats, *,
               schedule_time: float, update_time: float, step_time: float) -> StepStats:
    """A synchronous step: `sched` is the scheduler's counters and state after its update."""
    return StepStats(step=step, time=now, schedule_time=schedule_time, update_time=update_time,
                     step_time=step_time, batch_queue_depth=1, **runner_columns(runner_out), **sched.as_dict())


def async_step_stats(step: int, scheduled: SchedulerStats, state: SchedulerStats, now: float,
                     runner_out: ModelRunnerOutput, outputs: list[Any], *, schedule_time: float,
                     update_time: float, depth: int) -> StepStats:
    """A step of the batch queue: the counters of its schedule() (`scheduled`), the state after its
    update (`state`), `num_finished` from the outputs it delivered, `depth` steps in flight."""
    values = scheduled.as_dict()
    for key in STATE_COLUMNS:
        values[key] = getattr(state, key)
    values["num_finished"] = sum(1 for o in outputs if o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH))
    return StepStats(step=step, time=now, schedule_time=schedule_time, update_time=update_time,
                     batch_queue_depth=depth, **runner_columns(runner_out), **values)
