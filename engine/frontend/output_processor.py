"""Output processing on the front end: token ids -> text, stop strings, finished state.

`process_outputs` consumes one `EngineCoreOutputs` and returns a `RequestOutput`
per request that advanced (cumulative text and ids plus this step's delta) and the
ids of requests that a stop string finished: the caller must tell the core to
finish those (they stop on the front end, one step after the core produced the
token, exactly as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreOutput, EngineCoreOutputs, FinishReason, TokenLogprobs
from engine.tokenizer.detokenizer import DecodingTokenizer, IncrementalDetokenizer


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: DecodingTokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        index: int = 0,
    ) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        state = _RequestState(request_id, prompt, prompt_token_ids, params, detok, index=index)
        state.metrics.arrival_time = arrival_time
        if params.logprobs is not None:
            state.logprobs = []
        self._states[request_id] = state

    def abort_requests(
        self, request_ids: list[str], finish_reason: str = "abort", now: float = 0.0
    ) -> list[RequestOutput]:
        """Forget these requests; returns a final output for each one still known (its text
        and tokens so far, `finish_reason` "abort" or "error", no delta) so that what it
        produced is still counted (metrics) even though it never finished in the core."""
        finals = []
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is None:
                continue
            state.metrics.finished_time = now or state.metrics.finished_time
            completion = CompletionOutput(
                index=state.index, text=state.text, token_ids=list(state.token_ids), finish_reason=finish_reason,
                stop_reason=None, logprobs=list(state.logprobs) if state.logprobs is not None else None,
                text_delta="", token_ids_delta=[],
            )  # fmt: skip
            finals.append(RequestOutput(
                request_id=rid, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids, outputs=[completion],
                finished=True, num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
            ))  # fmt: skip
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        results: list[RequestOutput] = []
        to_finish: list[str] = []
        for eco in core_outputs.outputs:
            state = self._states.get(eco.request_id)
            if state is None:  # aborted on this side already
                continue
            out, stopped_here = self._process_one(state, eco, core_outputs.timestamp)
            results.append(out)
            if stopped_here:
                to_finish.append(eco.request_id)
            if out.finished:
                del self._states[eco.request_id]
        return results, to_finish

    def _process_one(self, state: _RequestState, eco: EngineCoreOutput, ts: float) -> tuple[RequestOutput, bool]:
        new_ids = list(eco.new_token_ids)
        m = state.metrics
        m.first_scheduled_time = eco.first_scheduled_time or m.first_scheduled_time
        m.first_token_time = eco.first_token_time or m.first_token_time
        m.token_times.extend([ts] * len(new_ids))
        m.num_draft_tokens, m.num_accepted_tokens = eco.num_draft_tokens, eco.num_accepted_tokens
        state.num_cached_tokens = max(state.num_cached_tokens, eco.num_cached_tokens)
        if eco.kv_bytes_loaded or eco.kv_bytes_saved or eco.num_external_cached_tokens:
            m.kv_external_tokens = eco.num_external_cached_tokens
            m.kv_bytes_loaded, m.kv_bytes_saved = eco.kv_bytes_loaded, eco.kv_bytes_saved
            m.kv_load_wait, m.kv_save_time = eco.kv_load_wait, eco.kv_save_time
        state.token_ids.extend(new_ids)
        if state.logprobs is not None and eco.new_logprobs:
            state.logprobs.extend(eco.new_logprobs)
        stop_str = state.detok.update(new_ids) if new_ids else None
        finish_reason = None if eco.finish_reason is None else str(FinishReason(eco.finish_reason))
        stop_reason = eco.stop_reason
        stopped_here = False
        if stop_str is not None and finish_reason is None:
            finish_reason, stop_reason, stopped_here = "stop", stop_str, True
        elif stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
        if eco.error:
            finish_reason = "error"
        finished = finish_reason is not None
        if finished:
            m.finished_time = eco.finished_time or ts
        delta = state.detok.get_next_output_text(finished, True)
        state.text += delta
        completion = CompletionOutput(
            index=state.index,
            text=state.text,
            token_ids=list(state.token_ids),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            text_delta=delta,
            token_ids_delta=new_ids,
        )
        out = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=m,
        )
        return out, stopped_here
