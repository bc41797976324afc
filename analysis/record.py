"""Per-request measurements: what a target returns and what the driver records.

Clock: every time here is `time.perf_counter()` based. A `TargetResult` holds raw
`perf_counter()` values; the driver turns it into a `RequestRecord` whose times are seconds
since the run start (the driver's `t0`). Every record of a run is made by `build_record`
(workloads/record_builder.py), whatever made the request happen (driver, simulator, offline
`LLM.generate`).

Three views of one response (METRICS.md), each with its own properties:
- per chunk, client clock (vLLM's definitions, `vllm bench serve`'s keys): content chunk j
  arrived at `chunk_times_s[j]`; TTFT = first chunk - start, E2EL = last chunk - start,
  ITL = each gap between successive chunks (a chunk of k tokens is one gap), TPOT =
  (E2EL - TTFT) / (output tokens - 1). `ttft_s`, `e2el_s`, `tpot_s`, `itls_s`.
- per token, client clock: a chunk's gap spread evenly over its `chunk_tokens` (server
  counts); the first chunk's extra tokens get its own time, so the gaps of a request sum to
  E2EL - TTFT and their mean is its TPOT. `itls_per_token_s`.
- per token, engine clock: with the `servelab` timing extension over HTTP
  (engine/entrypoints/timing.py) or an in-process engine, each token's engine step-end time
  as an offset from the first token, placed after the client's first chunk. `engine_*`.

Storage: `token_times` holds one time per output token, the engine's when `timing_source`
is "engine", else the client per-token times; `chunk_itls_s` and `chunk_tokens` hold the
chunk view. A record built without chunks (offline runs, the simulator, files written before
the chunk view was stored) takes one chunk per distinct token time.
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
    # Speculative decoding (in-process targets): drafts verified / accepted for this request.
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    kv: dict[str, float] | None = None  # external-KV figures (RequestMetrics.kv_figures), engine targets only
    # From the servelab timing extension (None without it): each output token's engine time
    # as an offset from the first token's (s), and the engine's arrival->first / last token.
    engine_token_offsets: list[float] | None = None
    server_ttft_s: float | None = None
    server_e2el_s: float | None = None
    # Times the request was sent again because a kept-alive connection turned out closed before the
    # server answered anything (HTTP targets; the server never saw the earlier attempt).
    reconnects: int = 0


def gaps(times: list[float]) -> list[float]:
    """Successive differences of `times` (one fewer than there are times)."""
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)]


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

    See the module doc for the three views. A request failed when it has no token (or an
    error): its latency properties return None and its gap lists are empty.
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
    timing_source: str = "chunks"  # token_times are: "engine" (engine step times) | "chunks" (client, spread)
    # Gaps between successive content chunks on the client's clock; None: one chunk per distinct token time.
    chunk_itls_s: list[float] | None = None
    chunk_tokens: list[int] | None = None  # output tokens per content chunk (server counts); None: unknown
    server_ttft_s: float | None = None  # engine arrival -> first token
    server_e2el_s: float | None = None  # engine arrival -> last token
    reconnects: int = 0  # sends repeated on a fresh connection (TargetResult.reconnects); start_s is the first's

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)

    @property
    def client_queue_s(self) -> float:
        return self.start_s - self.scheduled_s

    # ---- per chunk, client clock (vLLM's definitions) ----------------------------------

    @property
    def chunk_times_s(self) -> list[float]:
        """When each content chunk arrived (client clock); empty for a failed request."""
        if not self.ok:
            return []
        if self.chunk_itls_s is None:
            return sorted(set(self.token_times))
        times = [self.token_times[0]]  # the first token is placed at the first chunk in every view
        for gap in self.chunk_itls_s:
            times.append(times[-1] + gap)
        return times

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0] if self.ok else None

    @property
    def end_s(self) -> float | None:
        """The last content chunk's arrival (client clock)."""
        return self.chunk_times_s[-1] if self.ok else None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start_s if self.ok else None

    @property
    def e2el_s(self) -> float | None:
        """Last content chunk - start (vLLM's request latency)."""
        end = self.end_s
        return None if end is None else end - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1), client clock; None unless more than one output token."""
        if not self.ok or self.output_tokens <= 1:
            return None
        return (self.chunk_times_s[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive content chunks (vLLM's ITL; empty for a failed request)."""
        times = self.chunk_times_s
        return gaps(times)

    # ---- per token, client clock ---------------------------------------------------------

    @property
    def itls_per_token_s(self) -> list[float]:
        """Chunk gaps spread over their tokens (module doc); empty when the chunks' token counts
        are unknown beside engine token times."""
        if not self.ok:
            return []
        if self.chunk_tokens is not None:
            times = token_times_from_chunks(self.chunk_times_s, self.chunk_tokens)
        elif self.timing_source != "engine":
            times = self.token_times
        else:
            return []
        return gaps(times)

    # ---- per token, engine clock ---------------------------------------------------------

    @property
    def engine_timed(self) -> bool:
        return self.ok and self.timing_source == "engine"

    @property
    def engine_itls_s(self) -> list[float]:
        """Gaps between the engine steps that made successive tokens ([] without engine times)."""
        if not self.engine_timed:
            return []
        return gaps(self.token_times)

    @property
    def engine_tpot_s(self) -> float | None:
        """Engine first-to-last token span / (output tokens - 1)."""
        if not self.engine_timed or self.output_tokens <= 1:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def engine_e2el_s(self) -> float | None:
        """Client TTFT + engine first-to-last token span: the latency had every token been sent the
        moment the engine made it."""
        return self.token_times[-1] - self.start_s if self.engine_timed else None

    @property
    def front_end_s(self) -> float | None:
        """Client TTFT minus the engine's arrival->first token: network + HTTP front end (+ client)."""
        if self.server_ttft_s is None or self.ttft_s is None:
            return None
        return self.ttft_s - self.server_ttft_s
