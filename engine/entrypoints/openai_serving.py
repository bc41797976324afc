"""/v1/completions and /v1/chat/completions on top of AsyncLLM.

One request body becomes one `generate()` per prompt (each with `n` choices); choice
index = prompt_index * n + child index. Input is validated and tokenized here, once
(`InputProcessor.process`), before any request reaches the engine, so a bad prompt in
a batch queues nothing; `AsyncLLM` takes the resulting `ProcessedRequest` as is. Streams are SSE
(`data: {json}\\n\\n`, ending with `data: [DONE]`); an error after the stream started is
sent as an error event, then `[DONE]`. A client that leaves mid-stream ends it quietly: its
requests are aborted, nothing is logged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from engine.core.core_client import EngineDeadError
from engine.entrypoints import formatting as fmt
from engine.entrypoints import timing
from engine.entrypoints.errors import ApiError, from_value_error
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from engine.frontend.async_llm import AsyncLLM, RequestFailedError, merge_async_iterators
from engine.frontend.processor import ProcessedRequest
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from engine.structured_output.params import is_compile_busy, is_grammar_failure

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Job:
    """One prompt of the request, tokenized and validated."""

    prompt_index: int
    request: ProcessedRequest
    prompt_text: str | None  # for `echo`: the prompt, or its token ids decoded

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids


@dataclass(slots=True)
class ChoiceState:
    """What a stream has sent so far for one choice."""

    started: bool = False
    chars_sent: int = 0
    logprobs_sent: int = 0
    num_tokens: int = 0
    held_text: str = ""  # text of outputs held back to coalesce chunks (stream_chunk_tokens)


@dataclass
class _Call:
    """Everything about one HTTP request that the shared generation path needs."""

    chat: bool
    body: CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    jobs: list[Job]
    request_id: str
    logprobs_k: int | None
    timing: bool = False  # the servelab timing extension was asked for

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, model_name: str, max_logprobs: int, stream_chunk_tokens: int = 1) -> None:
        self.llm = llm
        self.model_name = model_name
        self.max_logprobs = max_logprobs
        # Tokens per SSE content chunk, at least (the last chunk may carry fewer). 1 = a chunk
        # per engine output; more imitates servers that coalesce (tests of per-token timing).
        self.stream_chunk_tokens = max(1, stream_chunk_tokens)
        self.token_text = fmt.TokenText(llm.tokenizer)

    # ---- preparation ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _prepare(self, body: CompletionRequest | ChatCompletionRequest) -> _Call:
        self.check_model(body.model)
        name = body.unsupported()
        if name is not None:
            raise ApiError(400, f"{name}: not implemented by this server", param=name, code="unsupported_parameter")
        chat = isinstance(body, ChatCompletionRequest)
        if isinstance(body, ChatCompletionRequest):
            k = (body.top_logprobs or 0) if body.logprobs else None
        else:
            k = body.logprobs
        if k is not None and k > self.max_logprobs:
            field = "top_logprobs" if chat else "logprobs"
            raise ApiError(400, f"{field}: must be <= {self.max_logprobs}, got {k}", param=field)
        try:
            params = body.sampling_params()
            if isinstance(body, ChatCompletionRequest):
                jobs = self._chat_jobs(body, params)
            else:
                jobs = self._completion_jobs(body, params)
        except ValueError as exc:
            raise from_value_error(exc) from None
        rid = fmt.new_id("chatcmpl" if chat else "cmpl")
        return _Call(chat, body, params, jobs, rid, k)

    def _completion_jobs(self, body: CompletionRequest, params: SamplingParams) -> list[Job]:
        ip = self.llm.input_processor
        jobs = []
        for i, prompt in enumerate(body.prompts()):
            req = ip.process(prompt, params, priority=body.priority)
            text = prompt if isinstance(prompt, str) else None
            if body.echo and text is None:
                text = self.llm.tokenizer.decode(req.prompt_token_ids)
            jobs.append(Job(i, req, text))
        return jobs

    def _chat_jobs(self, body: ChatCompletionRequest, params: SamplingParams) -> list[Job]:
        req = self.llm.input_processor.process(
            None, params, messages=body.message_dicts(), priority=body.priority,
            add_generation_prompt=body.add_generation_prompt,
        )
        return [Job(0, req, None)]

    def _outputs(self, call: _Call) -> Any:
        """Merged `(prompt_index, RequestOutput)` of every prompt of the call."""
        iterators = [
            self.llm.generate(job.request, request_id=f"{call.request_id}-{job.prompt_index}")
            for job in call.jobs
        ]
        return merge_async_iterators(iterators)

    # ---- entry points ---------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: web.Request) -> web.StreamResponse:
        return await self._serve(self._prepare(body), request)

    async def chat(self, body: ChatCompletionRequest, request: web.Request) -> web.StreamResponse:
        return await self._serve(self._prepare(body), request)

    async def _serve(self, call: _Call, request: web.Request) -> web.StreamResponse:
        call.timing = timing.wants_timing(call.body.servelab, request.headers)
        if call.body.stream:
            return await self._stream(call, request)
        return await self._collect(call)

    # ---- non-streaming ----------------------------------------------------------------

    async def _collect(self, call: _Call) -> web.Response:
        n = call.params.n
        finals: dict[int, CompletionOutput] = {}
        cached = [0] * len(call.jobs)
        timings: dict[int, dict[str, Any]] = {}
        merged = self._outputs(call)
        try:
            async with contextlib.aclosing(merged):
                async for pi, out in merged:
                    cached[pi] = max(cached[pi], out.num_cached_tokens)
                    for c in out.outputs:
                        if c.finished:
                            finals[pi * n + c.index] = c
                    if call.timing and out.finished:
                        timings[pi] = timing.timing_entry(pi, out.metrics)
        except (RequestFailedError, EngineDeadError) as exc:
            raise _failure(call, exc) from None
        choices = [self._final_choice(call, idx, finals[idx]) for idx in sorted(finals)]
        completion = sum(len(c.token_ids) for c in finals.values())
        prompt = sum(len(j.prompt_ids) for j in call.jobs)
        body = {
            "id": call.request_id,
            "object": call.object_name,
            "created": fmt.now_s(),
            "model": self.model_name,
            "choices": choices,
            "usage": fmt.usage(prompt, completion, sum(cached)),
        }
        if call.timing:
            body["servelab"] = timing.extension(timings)
        return web.Response(body=_json.encode(body), content_type="application/json")

    def _final_choice(self, call: _Call, index: int, c: CompletionOutput) -> dict[str, Any]:
        entries = c.logprobs or []
        if call.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None if call.logprobs_k is None else fmt.chat_logprobs(entries, call.logprobs_k, self.token_text),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        prefix = self._echo_prefix(call, index)
        lp = None
        if call.logprobs_k is not None:
            lp = fmt.completion_logprobs(entries, call.logprobs_k, self.token_text, len(prefix))
        return {
            "index": index,
            "text": prefix + c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _echo_prefix(self, call: _Call, index: int) -> str:
        if call.chat or not call.body.echo:  # type: ignore[union-attr]
            return ""
        return call.jobs[index // call.params.n].prompt_text or ""

    # ---- streaming --------------------------------------------------------------------

    async def _stream(self, call: _Call, request: web.Request) -> web.StreamResponse:
        merged = self._outputs(call)
        async with contextlib.aclosing(merged):
            head = await _first_output(call, merged)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                return await self._stream_events(call, resp, head, merged)
            except ConnectionResetError:  # the client left mid-stream (aiohttp's ClientConnectionResetError)
                # Nobody to answer: end quietly (aiohttp would log a traceback per dropped stream
                # and count a 500); leaving `aclosing` aborts the request in the engine.
                return resp

    async def _stream_events(
        self, call: _Call, resp: web.StreamResponse, head: list[tuple[int, Any]], merged: Any
    ) -> web.StreamResponse:
        """The SSE events of a stream whose response has started (`head`: outputs already taken
        from `merged`, which the caller closes)."""
        opts = call.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        states: dict[int, ChoiceState] = {}
        cached = [0] * len(call.jobs)
        prompt_tokens = sum(len(j.prompt_ids) for j in call.jobs)
        created = fmt.now_s()
        timings: dict[int, dict[str, Any]] = {}
        try:
            async for pi, out in _chain(head, merged):
                cached[pi] = max(cached[pi], out.num_cached_tokens)
                if call.timing and out.finished:
                    timings[pi] = timing.timing_entry(pi, out.metrics)
                for c in out.outputs:
                    index = pi * call.params.n + c.index
                    state = states.setdefault(index, ChoiceState())
                    if self._hold(c, state):
                        continue
                    usage = None
                    if continuous:
                        done = sum(s.num_tokens for s in states.values()) - state.num_tokens
                        usage = fmt.usage(prompt_tokens, done + len(c.token_ids), sum(cached))
                    for chunk in self._chunks(call, index, c, state, usage, include_usage):
                        await resp.write(self._event(call, created, chunk))
        except (RequestFailedError, EngineDeadError) as exc:
            await resp.write(_failure(call, exc).sse())
            await resp.write(DONE)
            return resp
        final: dict[str, Any] = {}
        if include_usage:
            completion = sum(s.num_tokens for s in states.values())
            final["usage"] = fmt.usage(prompt_tokens, completion, sum(cached))
        if call.timing:
            final["servelab"] = timing.extension(timings)
        if final:
            await resp.write(self._event(call, created, {"choices": [], **final}))
        await resp.write(DONE)
        return resp

    def _hold(self, c: CompletionOutput, state: ChoiceState) -> bool:
        """Hold back an unfinished output until `stream_chunk_tokens` new tokens are pending;
        its text is kept and sent with the next chunk."""
        if self.stream_chunk_tokens <= 1 or c.finished or not state.started:
            return False
        if len(c.token_ids) - state.num_tokens >= self.stream_chunk_tokens:
            return False
        state.held_text += c.text_delta
        return True

    def _event(self, call: _Call, created: int, chunk: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if call.chat else "text_completion"
        body = {"id": call.request_id, "object": obj, "created": created, "model": self.model_name, **chunk}
        return b"data: " + _json.encode(body) + b"\n\n"

    def _chunks(
        self,
        call: _Call,
        index: int,
        c: CompletionOutput,
        state: ChoiceState,
        usage: dict[str, Any] | None,
        include_usage: bool,
    ) -> list[dict[str, Any]]:
        """The SSE chunk bodies (without id/object/model) for one choice's new output."""
        chunks = []
        extra: dict[str, Any] = {"usage": usage} if usage is not None or include_usage else {}
        if call.chat and not state.started:
            role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            chunks.append({"choices": [role], **extra})
        text, state.held_text = state.held_text + c.text_delta, ""
        if not call.chat and not state.started:
            text = self._echo_prefix(call, index) + text
        state.started = True
        state.num_tokens = len(c.token_ids)
        new_lps = (c.logprobs or [])[state.logprobs_sent :]
        state.logprobs_sent += len(new_lps)
        if not text and not c.finished and not new_lps:
            return chunks
        choice = self._chunk_choice(call, index, c, text, new_lps, state.chars_sent)
        state.chars_sent += len(text)
        chunks.append({"choices": [choice], **extra})
        return chunks

    def _chunk_choice(
        self, call: _Call, index: int, c: CompletionOutput, text: str, new_lps: list[Any], offset: int
    ) -> dict[str, Any]:
        k = call.logprobs_k
        if call.chat:
            delta = {"content": text} if text or not c.finished else {}
            lp = None if k is None else fmt.chat_logprobs(new_lps, k, self.token_text)
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
        lp = None if k is None else fmt.completion_logprobs(new_lps, k, self.token_text, offset)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


def _failure(call: _Call, exc: RequestFailedError | EngineDeadError) -> ApiError:
    """A constrained request whose grammar failed in the engine (it does not compile, or its
    compile timed out: the message names the field) is the client's error, a 400; one refused
    while the grammar compiles in flight are at their cap is a 429 (retry later); any other
    failure is the engine's, a 500."""
    constrained = call.params.structured_outputs is not None
    if isinstance(exc, RequestFailedError) and constrained and is_compile_busy(str(exc)):
        return ApiError(429, str(exc), code="grammar_compiles_busy")
    if isinstance(exc, RequestFailedError) and constrained and is_grammar_failure(str(exc)):
        return from_value_error(ValueError(str(exc)))
    return ApiError(500, f"engine error: {exc}", code="engine_error")


async def _first_output(call: _Call, merged: Any) -> list[tuple[int, Any]]:
    """A constrained stream's first output, taken before the response starts: its grammar
    compiles first, so a grammar that fails (or times out) is still an HTTP error, not an
    error event inside a 200. Unconstrained streams start at once (nothing taken)."""
    if call.params.structured_outputs is None:
        return []
    try:
        return [await anext(merged)]
    except StopAsyncIteration:
        return []
    except (RequestFailedError, EngineDeadError) as exc:
        raise _failure(call, exc) from None


async def _chain(head: list[tuple[int, Any]], rest: Any) -> Any:
    for item in head:
        yield item
    async for item in rest:
        yield item
