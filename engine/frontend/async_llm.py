"""AsyncLLM: the asyncio front end of the engine (what the HTTP server and the workbench drive).

Input processing (chat template, tokenization, validation) and output processing
(incremental detokenization, stop strings) run here, on the caller's event loop; the
EngineCore runs in its own process (or a background thread, `multiprocess=False`)
behind `EngineCoreClient`. A caller that already validated its input (the HTTP
layer) hands `generate()` a `ProcessedRequest`, which is not checked again.

`generate()` yields cumulative `RequestOutput`s with this step's delta on each
`CompletionOutput` (`text_delta`, `token_ids_delta`) and per-token times in
`metrics.token_times`. Leaving the iterator early (break, cancellation of the
consuming task, a dropped HTTP client) aborts the request in the core.

Nothing here outlives a request: each engine step's `StepStats` and each finished
request go to the listeners (`step_listeners`, `finish_listeners`) and are not kept,
so a server that runs for weeks holds no per-step or per-request history (a buffer of
up to 100,000 steps, kept for a reader the server never had, grew with every step under
load, issue 60). A caller that wants the steps keeps them in its own listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.core.core_client import EngineCoreClient, EngineDeadError
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import InputProcessor, ProcessedRequest, child_request_ids, fan_out
from engine.hooks import StepHooks
from engine.kernels.kernel_choices import format_choices
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreOutputs, EngineCoreRequest, StepStats
from engine.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RequestFailedError(RuntimeError):
    """The engine finished a request with an error (a failed step); the message says why."""


@dataclass
class _Stream:
    """Per-request mailbox between the output dispatcher and `generate()`."""

    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False


class AsyncLLM:
    """Async engine front end. Build with `AsyncLLM.from_config(...)` (blocks while the model loads)."""

    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Tokenizer,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        max_model_len: int,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.max_model_len = max_model_len
        self._streams: dict[str, _Stream] = {}
        self.step_listeners: list[Callable[[StepStats], None]] = []
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []
        client.on_outputs = self._on_outputs
        client.on_dead = self._on_dead

    @classmethod
    def from_config(
        cls,
        engine_config: EngineConfig,
        multiprocess: bool = True,
        ready_timeout_s: float = 600.0,
        hooks_factory: Callable[[], StepHooks] | None = None,
    ) -> AsyncLLM:
        """Start the EngineCore (process or thread), wait until its model is loaded.

        `hooks_factory` builds the observation hooks (the profiler) where the core
        runs, once its engine is built; the engine closes them when it shuts down.
        With `multiprocess=True` it must be picklable (a module-level callable).
        """
        from engine.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(engine_config.model)
        client = EngineCoreClient.start(
            engine_config, multiprocess=multiprocess, ready_timeout_s=ready_timeout_s, hooks_factory=hooks_factory
        )
        assert client.ready is not None
        if client.ready.choices:
            logger.info(format_choices(client.ready.choices))
        max_len = client.ready.max_model_len
        return cls(client, tokenizer, InputProcessor(tokenizer, max_len), OutputProcessor(tokenizer), max_len)

    # ---- requests ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int] | ProcessedRequest | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        messages: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request; `n > 1` runs n child requests `f"{id}-{i}"`.

        `prompt` is text, token ids, or a `ProcessedRequest` from
        `input_processor.process` (then `sampling_params`, `priority` and `messages`
        come from it and must not be passed again).
        With n > 1 each yielded RequestOutput carries one CompletionOutput whose
        `index` names the child; `finished` is True only on the last one.
        Raises ValueError for invalid input (before anything is queued),
        RequestFailedError if the engine failed the request, EngineDeadError if the
        engine process is gone.
        """
        self.client.ensure_running()
        if not self.client.is_healthy():
            raise EngineDeadError("engine core is not running")
        if isinstance(prompt, ProcessedRequest):
            if sampling_params is not None or messages is not None or priority:
                raise ValueError("sampling_params: a ProcessedRequest carries its own parameters")
            req = prompt
        else:
            params = sampling_params or SamplingParams()
            req = self.input_processor.process(prompt, params, messages=messages, priority=priority)
        request_id = request_id or uuid.uuid4().hex
        for rid in child_request_ids(request_id, req.params.n):
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in flight")
        iterators = [self._generate_one(child, req.prompt, i) for i, child in enumerate(fan_out(request_id, req))]
        merged = merge_async_iterators(iterators)
        remaining = len(iterators)
        async with contextlib.aclosing(merged):  # an early exit aborts at once, not at GC
            async for _, out in merged:
                out.request_id = request_id
                remaining -= out.finished
                out.finished = remaining == 0
                yield out

    async def _generate_one(
        self, req: EngineCoreRequest, prompt: str | None, index: int
    ) -> AsyncGenerator[RequestOutput, None]:
        """One core request (one completion): queue it, relay its outputs, abort it on an early exit."""
        request_id = req.request_id
        self.output_processor.add_request(
            request_id, prompt, req.prompt_token_ids, req.sampling_params, arrival_time=req.arrival_time, index=index
        )
        stream = self._streams[request_id] = _Stream()
        try:
            self.client.add_request(req)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                stream.finished = item.finished
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self._abort_ids([request_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request (or all children of an n > 1 request); its iterator ends."""
        ids = [rid for rid in self._streams if rid == request_id or rid.startswith(f"{request_id}-")]
        self._abort_ids(ids)
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(asyncio.CancelledError(f"request {rid} aborted"))

    def _abort_ids(self, ids: list[str]) -> None:
        if not ids:
            return
        self._notify_finished(self.output_processor.abort_requests(ids, "abort", time.time()))
        self.client.abort_requests(ids)

    def _notify_finished(self, outputs: list[RequestOutput]) -> None:
        """Finished requests reach every finish listener once (metrics count aborts too)."""
        for out in outputs:
            for listener in self.finish_listeners:
                listener(out)

    # ---- outputs from the core ------------------------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        errors = {o.request_id: o.error for o in outputs.outputs if o.error}
        results, to_finish = self.output_processor.process_outputs(outputs)
        for out in results:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._notify_finished([out])
            if stream is None:
                continue
            error = errors.get(out.request_id)
            stream.queue.put_nowait(RequestFailedError(error) if error else out)
        if to_finish:  # stop strings end on the front end; finish them in the core (as offline)
            self.client.finish_requests(to_finish)
        if outputs.stats is not None:
            for step_listener in self.step_listeners:
                step_listener(outputs.stats)

    def _on_dead(self, err: EngineDeadError) -> None:
        now = time.time()
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(err)
            self._notify_finished(self.output_processor.abort_requests([rid], "error", now))

    # ---- state ----------------------------------------------------------------------

    async def get_stats(self) -> Any:
        """A fresh scheduler snapshot from the core (messages.EngineStats)."""
        return await self.client.get_stats()

    async def reset_prefix_cache(self) -> Any:
        return await self.client.call_utility("reset_prefix_cache")

    def is_healthy(self) -> bool:
        return self.client.is_healthy()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core and fail whatever is still in flight; wait up to `timeout_s` for it."""
        self._on_dead(EngineDeadError("engine shut down"))
        self.client.shutdown(timeout_s)


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield `(i, item)` from all iterators as items arrive.

    The first exception from any iterator is re-raised here; on any exit (done, error,
    the consumer closing or being cancelled) every iterator is closed, so each
    `generate()` underneath aborts its request.
    """
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | int] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(it):  # type: ignore[type-var]
                async for item in it:
                    queue.put_nowait((i, item))
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(i)  # this iterator is done

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            got = await queue.get()
            if isinstance(got, int):
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
