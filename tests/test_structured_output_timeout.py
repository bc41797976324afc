"""A grammar compile past `compile_timeout_s` over HTTP: the request gets a 400 naming the
timeout (streamed or not: a constrained stream starts only once its grammar is compiled),
about the timeout after its compile began, while a concurrent constrained request completes.

The server is the real app and engine, in this process (core on a thread), with a slow
compiler injected through the manager's compile seam by the engine factory.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
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

TIMEOUT_S = 0.5
STUCK = {"type": "object", "properties": {"x": {"type": "integer"}}, "title": "never-compiles"}
RELEASE = threading.Event()


def _slow_core(config: EngineConfig) -> Any:
    core = build_engine_core(config)
    manager = core.structured_output
    original = manager.compiler

    def compiler(tokenizer: Any, params: StructuredOutputsParams) -> Any:
        if "never-compiles" in params.key[1]:
            RELEASE.wait(120)  # released at teardown
        return original(tokenizer, params)

    manager.compiler = compiler
    return core


@pytest.fixture(scope="module")
def llm() -> Iterator[AsyncLLM]:
    cfg = EngineConfig.from_kwargs(max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=64,
                                   compile_timeout_s=TIMEOUT_S)  # fmt: skip
    tok = get_tokenizer(cfg.model)
    client = EngineCoreClient.start(cfg, multiprocess=False, engine_factory=_slow_core, ready_timeout_s=240)
    assert client.ready is not None
    max_len = client.ready.max_model_len
    engine = AsyncLLM(client, tok, InputProcessor(tok, max_len), OutputProcessor(tok), max_len)
    yield engine
    RELEASE.set()
    engine.shutdown()


async def _ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.text(), time.monotonic() - t0


def _body(response_format: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Describe a thing as JSON."}],
            "response_format": response_format, "temperature": 0, "max_tokens": 24, "stream": stream}  # fmt: skip


def test_a_compile_timeout_is_a_400_and_others_complete(llm: AsyncLLM) -> None:
    stuck = {"type": "json_schema", "json_schema": {"name": "stuck", "schema": STUCK}}
    fine = {"type": "json_schema", "json_schema": {"name": "fine", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}  # fmt: skip

    async def run() -> list[tuple[int, str, float]]:
        runner, port = await serve_locally(build_app(llm, ServerSettings(), "smollm2"))
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                return list(await asyncio.gather(
                    _ask(s, url, _body(stuck, stream=False)), _ask(s, url, _body(fine, stream=False)),
                    _ask(s, url, _body(stuck, stream=True)),  # the cached failure, streamed
                ))  # fmt: skip
        finally:
            await runner.cleanup()

    (s1, t1, dt1), (s2, t2, _), (s3, t3, _) = asyncio.run(run())
    for status, text in ((s1, t1), (s3, t3)):
        assert status == 400, text
        err = json.loads(text)["error"]
        assert err["param"] == "response_format" and err["type"] == "invalid_request_error"
        assert err["message"].startswith(f"response_format: grammar compile timed out after {TIMEOUT_S:g} s")
    assert dt1 < 30 * TIMEOUT_S  # ~0.5 s after the compile began (generous: 2 busy cores)
    assert s2 == 200, t2
    reply = json.loads(t2)["choices"][0]
    assert reply["finish_reason"] == "stop" and isinstance(json.loads(reply["message"]["content"])["ok"], bool)
