"""Per-request measurements: what a target returns and what the driver records.

Clock: every time here is `time.perf_counter()` based. A `TargetResult` holds raw
`perf_counter()` values; the driver turns it into a `RequestRecord` whose times are seconds
since the run start (the driver's `t0`).

Tokens per chunk: a stream chunk may carry several tokens (speculative decoding, coalesced
streams). `token_times_from_chunks` spreads the gap before a chunk evenly over its tokens, so
there is one time per token and ITLs are per token (METRICS.md). The first chunk's tokens all
get the first chunk's time (nothing tells when they were made), so the gaps of a request
always sum to E2EL - TTFT and their mean equals its TPOT.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TargetResult:
    """One response as a target saw it (times are `time.perf_counter()` values).

    `chunk_times[i]` is when content chunk i arrived and `chunk_tokens[i]` how many output
    tokens it carried (server counts). `output_tokens` / `prompt_tokens` are the server's
    usage counts (None when the server did not say). `error` is non-empty on failure.
    Server-side durations (seconds) are None when the target has no engine timestamps.
    """

    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str = ""
    error: str = ""
    output_text: str = ""
    output_token_ids: list[int] | None = None
    done_time: float = 0.0  # when the response was fully read (after any usage chunk)
    server_queued_s: float | None = None
    server_prefill_s: float | None = None
    server_decode_s: float | None = None


def token_times_from_chunks(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """One time per token: chunk j's k tokens fill the gap since chunk j-1 evenly.

    The first chunk's tokens all get its own time. Chunks with 0 tokens are skipped.
    """
    times: list[float] = []
    prev: float | None = None
    for t, k in zip(chunk_times, chunk_tokens, strict=True):
        if k <= 0:
            continue
        if prev is None:
            times.extend([t] * k)
        else:
            gap = (t - prev) / k
            times.extend(prev + gap * (i + 1) for i in range(k))
            times[-1] = t  # exact, whatever the float rounding
        prev = t
    return times


@dataclass(slots=True)
class RequestRecord:
    """One request as the driver measured it; times in seconds since the run start.

    `token_times` holds one receive time per output token (see module doc). A request failed
    when it has no token (or an error): its latency properties return None.
    """

    request_id: str
    scheduled_s: float
    start_s: float
    token_times: list[float] = field(default_factory=list)
    done_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    lateness_s: float = 0.0
    is_warmup: bool = False
    group: str = ""
    session_id: str = ""
    turn: int = 0
    output_text: str = ""
    output_token_ids: list[int] | None = None
    server_queued_s: float | None = None
    server_prefill_s: float | None = None
    server_decode_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)

    @property
    def client_queue_s(self) -> float:
        return self.start_s - self.scheduled_s

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0] if self.ok else None

    @property
    def end_s(self) -> float | None:
        return self.token_times[-1] if self.ok else None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start_s if self.ok else None

    @property
    def e2el_s(self) -> float | None:
        return self.token_times[-1] - self.start_s if self.ok else None

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None unless more than one output token."""
        if not self.ok or self.output_tokens <= 1:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive tokens (empty for a failed request)."""
        if not self.ok:
            return []
        tt = self.token_times
        return [b - a for a, b in zip(tt[:-1], tt[1:], strict=True)]


def record_from_result(
    request_id: str,
    result: TargetResult,
    *,
    t0: float,
    scheduled_s: float,
    start_s: float,
    lateness_s: float,
) -> RequestRecord:
    """Turn a target's raw result into a run-relative record (the driver's one conversion)."""
    chunk_times = [t - t0 for t in result.chunk_times]
    tokens = token_times_from_chunks(chunk_times, result.chunk_tokens)
    n_out = result.output_tokens if result.output_tokens is not None else len(tokens)
    error = result.error
    if not error and not tokens:
        error = "no content chunk received"
    return RequestRecord(
        request_id=request_id,
        scheduled_s=scheduled_s,
        start_s=start_s,
        token_times=tokens,
        done_s=(result.done_time - t0) if result.done_time else (tokens[-1] if tokens else start_s),
        prompt_tokens=result.prompt_tokens or 0,
        output_tokens=n_out,
        finish_reason=result.finish_reason,
        error=error,
        lateness_s=lateness_s,
        output_text=result.output_text,
        output_token_ids=result.output_token_ids,
        server_queued_s=result.server_queued_s,
        server_prefill_s=result.server_prefill_s,
        server_decode_s=result.server_decode_s,
    )
