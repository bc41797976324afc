"""Grammar compiles in flight are bounded (issue 60 item 2).

A compile past `compile_timeout_s` is written off but its thread goes on (a native compile
cannot be stopped), so N pathological schemas used to leave N compiles burning CPU. Here 50
distinct slow schemas reach the real app and engine over HTTP (core on a thread, the slow
compile injected through the manager's compile seam): at most
`structured_outputs_config.max_compiles_in_flight` compiles ever run, the other requests are
answered 429 at once with a message naming the setting, a grammar already compiled and an
unconstrained request are still served meanwhile, and once the slow compiles end a new grammar
compiles again.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from local_server import serve_locally

from engine.config import EngineConfig
from engine.core.core_client import EngineCoreClient
from engine.core.core_proc import build_engine_core
from engine.entrypoints.api_server import ServerSettings, build_app
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import InputProcessor
from engine.structured_output.params import StructuredOutputsParams
from engine.tokenizer import get_tokenizer

pytestmark = pytest.mark.timeout(300)

CAP = 4
TIMEOUT_S = 0.5
SLOW = 50
RELEASE = threading.Event()


class _Count:
    """Slow compiles running now and at most, and how many began."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = self.started = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.started += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


SLOW_COMPILES = _Count()


def _slow_core(config: EngineConfig) -> Any:
    core = build_engine_core(config)
    original = core.structured_output.compiler

    def compiler(tokenizer: Any, params: StructuredOutputsParams) -> Any:
        if "slow-schema" not in params.key[1]:
            return original(tokenizer, params)
        SLOW_COMPILES.enter()
        try:
            RELEASE.wait(120)  # a pathological schema: released at the end of the test
            return original(tokenizer, params)
        finally:
            SLOW_COMPILES.leave()

    core.structured_output.compiler = compiler
    return core


@pytest.fixture(scope="module")
def llm() -> Iterator[AsyncLLM]:
    cfg = EngineConfig.from_kwargs(max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=64,
                                   compile_timeout_s=TIMEOUT_S, max_compiles_in_flight=CAP)  # fmt: skip
    tok = get_tokenizer(cfg.model)
    client = EngineCoreClient.start(cfg, multiprocess=False, engine_factory=_slow_core, ready_timeout_s=240)
    assert client.ready is not None
    max_len = client.ready.max_model_len
    engine = AsyncLLM(client, tok, InputProcessor(tok, max_len), OutputProcessor(tok), max_len)
    yield engine
    RELEASE.set()
    engine.shutdown()


def _schema(title: str, key: str = "x") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {key: {"type": "boolean"}}, "required": [key],
        "additionalProperties": False, "title": title}}}  # fmt: skip


def _body(response_format: dict[str, Any] | None, stream: bool = False) -> dict[str, Any]:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Answer as JSON."}], "temperature": 0,
            "max_tokens": 12, "stream": stream}  # fmt: skip
    if response_format is not None:
        body["response_format"] = response_format
    return body


async def _ask(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, dict[str, str]]:
    async with s.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


async def _server(llm: AsyncLLM) -> AsyncIterator[str]:
    runner, port = await serve_locally(build_app(llm, ServerSettings(), "smollm2"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_fifty_slow_schemas_leave_at_most_the_cap_compiling(llm: AsyncLLM) -> None:
    async def run() -> dict[str, Any]:
        async for url in _server(llm):
            async with aiohttp.ClientSession() as s:
                cached = await _ask(s, url, _body(_schema("fine")))  # compiled before the flood
                slow = await asyncio.gather(*(
                    _ask(s, url, _body(_schema(f"slow-schema-{i}"), stream=i % 2 == 1)) for i in range(SLOW)))
                # the cap is reached and the slow compiles still run: no new grammar is taken ...
                busy = await _ask(s, url, _body(_schema("new-while-busy")))
                # ... but a grammar already compiled, and an unconstrained request, are served
                again = await _ask(s, url, _body(_schema("fine")))
                plain = await _ask(s, url, _body(None))
                peak_while_busy = SLOW_COMPILES.peak
                RELEASE.set()
                deadline = time.monotonic() + 60
                while SLOW_COMPILES.now and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.2)  # the threads leave the cache's books after the compile returns
                after = await _ask(s, url, _body(_schema("new-after", key="y")))
                return {"cached": cached, "slow": slow, "busy": busy, "again": again, "plain": plain,
                        "peak": peak_while_busy, "after": after}  # fmt: skip
        raise AssertionError("no server")

    r = asyncio.run(run())
    assert r["cached"][0] == 200, r["cached"][1]
    statuses = [status for status, _, _ in r["slow"]]
    timed_out = [text for status, text, _ in r["slow"] if status == 400]
    refused = [(text, headers) for status, text, headers in r["slow"] if status == 429]
    assert len(timed_out) + len(refused) == SLOW, statuses
    assert len(timed_out) == CAP, statuses  # the first CAP compile (and time out); none after them
    assert all("grammar compile timed out" in json.loads(t)["error"]["message"] for t in timed_out)
    assert r["peak"] == CAP and SLOW_COMPILES.started == CAP  # never more than CAP compiles ran
    for text, headers in refused + [(r["busy"][1], r["busy"][2])]:
        err = json.loads(text)["error"]
        assert err["code"] == "grammar_compiles_busy" and err["type"] == "rate_limit_error", err
        assert f"{CAP} grammar compiles in flight" in err["message"], err["message"]
        assert "structured_outputs_config.max_compiles_in_flight" in err["message"], err["message"]
        assert "retry" in err["message"] and headers.get("Retry-After") == "1"
    assert r["busy"][0] == 429
    assert r["again"][0] == 200 and r["plain"][0] == 200, (r["again"], r["plain"])
    assert r["after"][0] == 200, r["after"][1]
    assert isinstance(json.loads(json.loads(r["after"][1])["choices"][0]["message"]["content"])["y"], bool)
