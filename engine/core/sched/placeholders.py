"""Output placeholders: scheduling a request's next token before its last one is known.

With async scheduling the EngineCore schedules step N+1 while step N runs. A request
that samples in step N then has a token whose id is not known yet; the scheduler
counts it in `request.num_output_placeholders` and treats it as known for planning:

- a running request wants `num_tokens + num_output_placeholders - num_computed_tokens`
  tokens (1 for a decode whose input is step N's sampled token: the model runner
  takes that id from step N's output, never from the scheduler);
- a request whose placeholders will certainly end it by length (max_tokens, or the
  length limit) is not scheduled again: the step would compute a token nobody gets;
- `update_from_output` turns placeholders into tokens (`resolve`); a request that
  stops (EOS, stop token) while a later step is in flight has that later step's
  token discarded, because the request is no longer running when it arrives;
- a preempted request drops its placeholders: its step in flight samples a token
  that is discarded, and the recompute samples it again.
"""

from __future__ import annotations

from engine.request import Request


def tokens_wanted(request: Request) -> int:
    """Tokens a running request could compute now (placeholders count as known)."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def ends_in_flight(request: Request, max_model_len: int) -> bool:
    """True when a step in flight will finish the request by length: nothing more to schedule."""
    if not request.num_output_placeholders:
        return False
    num_tokens = request.num_tokens + request.num_output_placeholders
    if num_tokens >= max_model_len:
        return True
    max_tokens = request.max_tokens
    return max_tokens is not None and request.num_output_tokens + request.num_output_placeholders >= max_tokens


def add_placeholder_if_sampling(request: Request) -> None:
    """After `num_computed_tokens` advanced: a step that reaches every token (known or
    placeholder) samples one more, still unknown."""
    if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
        request.num_output_placeholders += 1


def resolve(request: Request, num_sampled: int) -> None:
    """A step's `num_sampled` tokens arrived for this request."""
    request.num_output_placeholders = max(0, request.num_output_placeholders - num_sampled)
