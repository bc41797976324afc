"""The `servelab` timing extension: the engine's own timestamps of a request, over HTTP.

Opt-in, per request: a body field `"servelab": {"timing": true}` or a header
`X-Servelab-Timing: 1` (a header is ignored by servers that do not know it, so a client can
always send it). When asked, the server adds a top-level `"servelab"` object:
- streaming: on one extra chunk just before `data: [DONE]` (the usage chunk when
  `stream_options.include_usage`, else a chunk with `"choices": []`);
- non-streaming: on the response body.

    "servelab": {"clock": "unix", "timing": [{
        "index": 0,                       # prompt index (one engine request per prompt)
        "arrival": t, "scheduled": t, "first_token": t, "finished": t,   # time.time(), engine clock
        "token_times": [t, ...],          # end of the engine step that made each output token
        "phases_s": {"queue": s, "prefill": s, "decode": s, "preempted": null}}]}

`preempted` is null: per-request preempted time is not exported by the engine core yet.
Clients without the extension never see the field.
"""

from __future__ import annotations

from typing import Any

from engine.outputs import RequestMetrics

HEADER = "X-Servelab-Timing"
_TRUE = {"1", "true", "yes", "on"}


def wants_timing(body_option: Any, headers: Any) -> bool:
    """True when the request asked for the extension (body `servelab.timing` or the header)."""
    if body_option is not None and getattr(body_option, "timing", False):
        return True
    return str(headers.get(HEADER, "")).strip().lower() in _TRUE


def timing_entry(index: int, m: RequestMetrics) -> dict[str, Any]:
    """One engine request's timestamps and phase split (see the module doc)."""
    return {
        "index": index,
        "arrival": m.arrival_time,
        "scheduled": m.first_scheduled_time or None,
        "first_token": m.first_token_time or None,
        "finished": m.finished_time or None,
        "token_times": list(m.token_times),
        "phases_s": {"queue": m.queued_time, "prefill": m.prefill_time, "decode": m.decode_time,
                     "preempted": None},
    }


def extension(entries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {"clock": "unix", "timing": [entries[i] for i in sorted(entries)]}
