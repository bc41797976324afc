"""Building a run's `RequestRecord`s from the `RequestSpec` sent and the times observed.

Above both `workloads.spec` (what was sent) and `analysis.record` (what was measured), so that
neither of those two imports the other: a spec's follow-up hook reads a record, and a record is
built from a spec. The views and clocks the records hold are described in analysis/record.py.
"""

from __future__ import annotations

from analysis.record import RequestRecord, TargetResult, gaps, token_times_from_chunks
from workloads.spec import RequestSpec


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
    chunk_tokens: list[int] | None = None,
    server_ttft_s: float | None = None,
    server_e2el_s: float | None = None,
    reconnects: int = 0,
) -> RequestRecord:
    """The one builder of a run's records (driver, simulator, offline runs, scripted ideals).

    Times are seconds since the run start. The spec gives the identity fields (id, warm-up
    flag, group, session, turn). Rules every target shares: `prompt_tokens` falls back to the
    spec's `prompt_len` when not known (None or 0); `output_tokens` to one per token time; a
    request that received no token and has no error gets "no content chunk received".
    `chunk_itls_s` / `chunk_tokens`: the chunk view (None: one chunk per distinct token time);
    `token_times[0]` must be the first chunk's arrival.
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
        chunk_tokens=chunk_tokens,
        server_ttft_s=server_ttft_s,
        server_e2el_s=server_e2el_s,
        reconnects=reconnects,
    )


def engine_token_times(first_chunk_s: float, offsets: list[float]) -> list[float]:
    """Token times on the client clock from the engine's per-token offsets (analysis/record.py's module doc)."""
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
    source = "chunks"
    # the chunk view, kept whatever the token times: vLLM's figures come from it
    chunk_itls = gaps(chunk_times) if tokens else None
    offsets = result.engine_token_offsets
    if offsets and tokens and not result.error and len(offsets) == len(tokens):
        source = "engine"
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
        chunk_tokens=list(result.chunk_tokens) if tokens else None,
        server_ttft_s=result.server_ttft_s,
        server_e2el_s=result.server_e2el_s,
        reconnects=result.reconnects,
    )
