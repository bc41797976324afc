"""AsyncLLM over the echo engine: real tokenizer (byte level) and real input/output processors.

The echo engine returns the prompt's token ids one per step, so with the byte-level
tokenizer the generated text is the prompt repeated: every expectation is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading

import pytest
from server_utils import POISON_TOKEN, echo_async_llm, make_echo_engine

from engine.config import EngineConfig
from engine.core.core_client import EngineCoreClient, EngineDeadError
from engine.frontend.async_llm import AsyncLLM, RequestFailedError
from engine.hooks import NullHooks
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


async def _drain(llm: AsyncLLM, prompt: object, params: SamplingParams | None, **kw: object) -> list:
    return [out async for out in llm.generate(prompt, params, **kw)]


async def _until_idle(llm: AsyncLLM, timeout_s: float = 1.0) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while (await llm.get_stats()).num_running:
        assert loop.time() - t0 < timeout_s, "request still running in the core"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["thread", "process"])
def test_generate_deltas_metrics_and_stats(multiprocess: bool) -> None:
    async def main() -> None:
        llm = echo_async_llm(multiprocess=multiprocess)
        steps: list = []
        llm.step_listeners.append(steps.append)  # the front end keeps no steps itself (issue 60)
        try:
            outs = await _drain(llm, "abc", SamplingParams(max_tokens=7, temperature=0))
            last = outs[-1].outputs[0]
            prompt_ids = outs[-1].prompt_token_ids
            assert last.token_ids == [prompt_ids[i % len(prompt_ids)] for i in range(7)]
            assert "".join(o.outputs[0].text_delta for o in outs) == last.text
            assert last.finish_reason == "length" and outs[-1].finished
            assert sum(o.finished for o in outs) == 1
            assert len(outs[-1].metrics.token_times) == 7
            assert len(steps) >= 7 and all(s.step > 0 for s in steps)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_stop_string_n_and_validation() -> None:
    async def main() -> None:
        llm = echo_async_llm()
        try:
            outs = await _drain(llm, "xyz", SamplingParams(max_tokens=50, stop=["zx"]))
            assert outs[-1].outputs[0].finish_reason == "stop"
            await _until_idle(llm)  # the stop string aborted it in the core too
            outs = await _drain(llm, "ab", SamplingParams(n=3, max_tokens=3, seed=1), request_id="p")
            assert {o.request_id for o in outs} == {"p"}
            finished = sorted(o.outputs[0].index for o in outs if o.outputs[0].finished)
            assert finished == [0, 1, 2] and outs[-1].finished and sum(o.finished for o in outs) == 1
            with pytest.raises(ValueError, match="prompt"):
                await _drain(llm, "", SamplingParams())
            with pytest.raises(ValueError, match="max_tokens"):
                await _drain(llm, "a", SamplingParams(max_tokens=10_000))
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_cancel_break_and_abort_free_the_request() -> None:
    async def main() -> None:
        llm = echo_async_llm(step_delay_ms=2)
        try:
            params = SamplingParams(max_tokens=100)
            task = asyncio.create_task(_drain(llm, "hello", params))
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await _until_idle(llm)
            async for _ in llm.generate("hello", params):
                break
            await _until_idle(llm)
            assert llm.num_in_flight == 0

            async def consume() -> list:
                return await _drain(llm, "hello", params, request_id="victim")

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            await llm.abort("victim")
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until_idle(llm)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_step_error_and_engine_death() -> None:
    async def main() -> None:
        llm = echo_async_llm(multiprocess=True, step_delay_ms=2)
        try:
            with pytest.raises(RequestFailedError, match="poisoned"):
                await _drain(llm, [POISON_TOKEN], SamplingParams(max_tokens=3))
            ok = await _drain(llm, "ok", SamplingParams(max_tokens=2))
            assert ok[-1].finished
            task = asyncio.create_task(_drain(llm, "long", SamplingParams(max_tokens=100)))
            await asyncio.sleep(0.05)
            assert llm.client.pid is not None
            os.kill(llm.client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(task, 1.0)
            assert not llm.is_healthy()
            with pytest.raises(EngineDeadError):
                await _drain(llm, "late", SamplingParams())
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_stop_string_finishes_as_stopped_in_the_core_as_offline() -> None:
    async def main() -> None:
        llm = echo_async_llm()
        try:
            outs = await _drain(llm, "xyz", SamplingParams(max_tokens=50, stop=["zx"]), request_id="s")
            assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == "zx"
            await _until_idle(llm)
            engine = llm.client._thread_core.engine  # type: ignore[union-attr]
            # A FINISH message, not an ABORT: the same status the offline LLM gives a stop string.
            assert engine.finished_by_front_end == [("s", RequestStatus.FINISHED_STOPPED)]
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_a_processed_request_is_admitted_without_processing_it_again() -> None:
    async def main() -> None:
        llm = echo_async_llm()
        try:
            req = llm.input_processor.process("abc", SamplingParams(n=2, max_tokens=3, seed=5), priority=0)
            calls = []
            real = llm.input_processor.process
            llm.input_processor.process = lambda *a, **k: calls.append(a) or real(*a, **k)  # type: ignore[method-assign]
            outs = await _drain(llm, req, None, request_id="p")
            assert calls == [] and outs[-1].finished and {o.request_id for o in outs} == {"p"}
            done = sorted(o.outputs[0].index for o in outs if o.outputs[0].finished)
            assert done == [0, 1] and all(o.prompt == "abc" for o in outs)
            with pytest.raises(ValueError, match="sampling_params"):
                await _drain(llm, req, SamplingParams())
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_hooks_are_built_where_the_core_runs_and_closed_with_it() -> None:
    events: list[tuple[str, str]] = []

    class Hooks(NullHooks):
        def close(self) -> None:
            events.append(("close", threading.current_thread().name))

    def factory() -> Hooks:
        events.append(("build", threading.current_thread().name))
        return Hooks()

    client = EngineCoreClient.start(EngineConfig(), multiprocess=False, engine_factory=make_echo_engine,
                                    ready_timeout_s=30, hooks_factory=factory)
    client.shutdown()
    assert events == [("build", "EngineCore"), ("close", "EngineCore")]
