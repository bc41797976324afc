"""Stop conditions checked on every token the scheduler appends.

Order: EOS (unless ignore_eos) and stop token ids, both ignored while fewer than
`min_tokens` outputs exist; then the length limits (max_tokens, max_model_len).
A stop token sampled as the last allowed token therefore reports "stop". Stop
strings are not checked here: the detokenizer on the front end finds them and
calls `Scheduler.finish_requests`.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """After the request's last token was appended: set its finished status and
    stop_reason if it must stop, and return whether it did."""
    params = request.sampling_params
    last = request.all_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = request.max_tokens
    if request.num_tokens >= max_model_len or (
        max_tokens is not None and request.num_output_tokens >= max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
