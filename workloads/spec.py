"""What to send: one `RequestSpec` per request, and the hook for dependent requests.

A workload is a `list[RequestSpec]` sorted by `arrival_s` (planned send time in seconds
since the run start). Closed-loop workloads carry `arrival_s = 0` everywhere; the driver's
concurrency decides when each is sent.

Dependent requests (multi-turn sessions): a spec may carry `follow_up`, a callable the
driver calls once that request has finished, with the spec and its `RequestRecord`. It
returns the next turn's spec (its `arrival_s` is the planned send time, usually the finish
time plus a think time) or `None` when the session ends. The driver never sends a follow-up
before its predecessor has finished, so the next prompt can contain the previous answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from analysis.record import RequestRecord

FollowUp = Callable[["RequestSpec", RequestRecord], "RequestSpec | None"]


@dataclass(slots=True)
class RequestSpec:
    """One request to send. Give `prompt` (text), `prompt_token_ids`, or both.

    `prompt_len` is the intended prompt length in tokens (the target's tokenizer decides
    the real count, which the server reports back in usage).
    """

    request_id: str
    arrival_s: float
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = True
    group: str = ""
    is_warmup: bool = False
    priority: int = 0
    session_id: str = ""
    turn: int = 0
    follow_up: FollowUp | None = None

    def __post_init__(self) -> None:
        if self.prompt is None and self.prompt_token_ids is None:
            raise ValueError(f"request {self.request_id}: needs prompt or prompt_token_ids")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1")

    def describe(self) -> dict[str, Any]:
        """Plain fields for logs and run configs (no prompt text, no callables)."""
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "group": self.group,
            "is_warmup": self.is_warmup,
            "session_id": self.session_id,
            "turn": self.turn,
        }


def sort_workload(specs: list[RequestSpec]) -> list[RequestSpec]:
    """Return the specs sorted by planned arrival (stable, so ties keep their order)."""
    return sorted(specs, key=lambda s: s.arrival_s)
