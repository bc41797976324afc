"""A request's EngineCoreOutput: what one step (or its end) sends the front end about it."""

from __future__ import annotations

from engine.request import Request, RequestStatus, finish_reason, is_finished
from engine.seam import EngineCoreOutput, TokenLogprobs

# RequestStatus -> FinishReason value (finished statuses only).
_FINISH_REASON_VALUES = {s: int(finish_reason(s)) for s in RequestStatus if is_finished(s)}


def make_output(request: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None) -> EngineCoreOutput:
    """The request's new tokens (and their logprobs), its finish reason once finished, and the
    timestamps and KV figures the front end turns into RequestMetrics."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=_FINISH_REASON_VALUES.get(request.status),
        stop_reason=request.stop_reason,
        new_logprobs=logprobs,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
        error=request.error,
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
        num_external_cached_tokens=request.num_external_cached_tokens,
        kv_bytes_loaded=request.kv_bytes_loaded,
        kv_bytes_saved=request.kv_bytes_saved,
        kv_load_wait=request.kv_load_wait,
        kv_save_time=request.kv_save_time,
    )
