"""Per-request measurements: what a target returns and what the driver records.

Clock: every time here is `time.perf_counter()` based. A `TargetResult` holds raw
`perf_counter()` values; the driver turns it into a `RequestRecord` whose times are seconds
since the run start (the driver's `t0`). Every record of a run is made by `build_record`,
whatever made the request happen (driver, simulator, offline `LLM.generate`).

Tokens per chunk: a stream chunk may carry several tokens (speculative decoding, coalesced
streams). `token_times_from_chunks` spreads the gap before a chunk evenly over its tokens, so
there is one time per token and ITLs are per token (METRICS.md). The first chunk's tokens all
get the first chunk's time (nothing tells when they were made), so the gaps of a request
always sum to E2EL - TTFT and their mean equals its TPOT.

Engine timing over HTTP: when a server returns the `servelab` timing extension
(engine/entrypoints/timing.py), the target keeps each token's engine step-end time as an
offset from the first token. The record then places token i at (client first-chunk time +
engine offset i): TTFT stays the client's, every later gap is the engine's own (per token,
whatever the chunking), so E2EL = client TTFT + engine first-to-last-token span. The
per-chunk gaps are kept beside it (`chunk_itls_s`) and `timing_source` says which was used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workloads.spec import RequestSpec


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
    # Speculative decoding (in-process targets): drafts verified / accepted for this request.
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    kv: dict[str, float] | None = None  # external-KV figures (RequestMetrics.kv_figures), engine targets only
    # From the servelab timing extension (None without it): each output token's engine time
    # as an offset from the first token's (s), and the engine's arrival->first / last token.
    engine_token_offsets: list[float] | None = None
    server_ttft_s: float | None = None
    server_e2el_s: float | None = None


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
    spec_draft_tokens: int | None = None  # speculative decoding (in-process targets)
    spec_accepted_tokens: int | None = None
    server_queued_s: float | None = None
    server_prefill_s: float | None = None
    server_decode_s: float | None = None
    # The prompt length the workload meant to send; `prompt_tokens` is the server's count when it
    # gave one (a chat template, a tokenizer other than the workload's make them differ).
    sent_prompt_tokens: int = 0
    kv: dict[str, float] | None = None  # external-KV figures (requests.csv KV_COLUMNS)
    timing_source: str = "chunks"  # "engine" (engine step times) | "chunks" (chunk arrival, spread)
    chunk_itls_s: list[float] | None = None  # gaps between content chunks (engine timing over HTTP only)
    server_ttft_s: float | None = None  # engine arrival -> first token
    server_e2el_s: float | None = None  # engine arrival -> last token

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
    def front_end_s(self) -> float | None:
        """Client TTFT minus the engine's arrival->first token: network + HTTP front end (+ client)."""
        if self.server_ttft_s is None or self.ttft_s is None:
            return None
        return self.ttft_s - self.server_ttft_s

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive tokens (empty for a failed request)."""
        if not self.ok:
            return []
        tt = self.token_times
        return [b - a for a, b in zip(tt[:-1], tt[1:], strict=True)]


def build_record(
    spec: RequestSpec,
    *,
    scheduled_s: float,
    start_s: float,
    token_times: list[float],
    done_s: float,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    finish_reason: str = "",
    error: str = "",
    lateness_s: float = 0.0,
    output_text: str = "",
    output_token_ids: list[int] | None = None,
    server_queued_s: float | None = None,
    server_prefill_s: float | None = None,
    server_decode_s: float | None = None,
    spec_draft_tokens: int | None = None,
    spec_accepted_tokens: int | None = None,
    kv: dict[str, float] | None = None,
    timing_source: str = "chunks",
    chunk_itls_s: list[float] | None = None,
    server_ttft_s: float | None = None,
    server_e2el_s: float | None = None,
) -> RequestRecord:
    """The one builder of a run's records (driver, simulator, offline runs, scripted ideals).

    Times are seconds since the run start. The spec gives the identity fields (id, warm-up
    flag, group, session, turn). Rules every target shares: `prompt_tokens` falls back to the
    spec's `prompt_len` when not known (None or 0); `output_tokens` to one per token time; a
    request that received no token and has no error gets "no content chunk received".
    """
    if not error and not token_times:
        error = "no content chunk received"
    return RequestRecord(
        request_id=spec.request_id,
        scheduled_s=scheduled_s,
        start_s=start_s,
        token_times=token_times,
        done_s=done_s,
        prompt_tokens=prompt_tokens or spec.prompt_len,
        sent_prompt_tokens=spec.prompt_len,
        output_tokens=len(token_times) if output_tokens is None else output_tokens,
        finish_reason=finish_reason,
        error=error,
        lateness_s=lateness_s,
        is_warmup=spec.is_warmup,
        group=spec.group,
        session_id=spec.session_id,
        turn=spec.turn,
        output_text=output_text,
        output_token_ids=output_token_ids,
        server_queued_s=server_queued_s,
        server_prefill_s=server_prefill_s,
        server_decode_s=server_decode_s,
        spec_draft_tokens=spec_draft_tokens,
        spec_accepted_tokens=spec_accepted_tokens,
        kv=kv,
        timing_source=timing_source,
        chunk_itls_s=chunk_itls_s,
        server_ttft_s=server_ttft_s,
        server_e2el_s=server_e2el_s,
    )


def engine_token_times(first_chunk_s: float, offsets: list[float]) -> list[float]:
    """Token times on the client clock from the engine's per-token offsets (module doc)."""
    return [first_chunk_s + off for off in offsets]


def record_from_result(
    spec: RequestSpec,
    result: TargetResult,
    *,
    t0: float,
    scheduled_s: float,
    start_s: float,
    lateness_s: float,
    now_s: float,
) -> RequestRecord:
    """A target's raw result as a run-relative record (`t0`: the run start in perf_counter time).

    `now_s` (when the driver stores it) is the done time of a result that has none.
    """
    chunk_times = [t - t0 for t in result.chunk_times]
    tokens = token_times_from_chunks(chunk_times, result.chunk_tokens)
    source, chunk_itls = "chunks", None
    offsets = result.engine_token_offsets
    if offsets and tokens and not result.error and len(offsets) == len(tokens):
        source = "engine"
        chunk_itls = [b - a for a, b in zip(chunk_times[:-1], chunk_times[1:], strict=True)]
        tokens = engine_token_times(tokens[0], offsets)
    return build_record(
        spec,
        scheduled_s=scheduled_s,
        start_s=start_s,
        token_times=tokens,
        done_s=(result.done_time - t0) if result.done_time else now_s,
        prompt_tokens=result.prompt_tokens,
        output_tokens=result.output_tokens,
        finish_reason=result.finish_reason,
        error=result.error,
        lateness_s=lateness_s,
        output_text=result.output_text,
        output_token_ids=result.output_token_ids,
        server_queued_s=result.server_queued_s,
        server_prefill_s=result.server_prefill_s,
        server_decode_s=result.server_decode_s,
        spec_draft_tokens=result.spec_draft_tokens,
        spec_accepted_tokens=result.spec_accepted_tokens,
        kv=result.kv,
        timing_source=source,
        chunk_itls_s=chunk_itls,
        server_ttft_s=result.server_ttft_s,
        server_e2el_s=result.server_e2el_s,
    )
