"""/metrics counts aborted and disconnected requests too (issue 13, defect 4).

Before the fix only requests that finished in the core were counted: a client that
dropped its stream left no trace in `vllm:request_success_total` nor in the token counters.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from server_utils import echo_async_llm, free_port

from engine.entrypoints.api_server import ServerSettings, build_app

pytestmark = pytest.mark.timeout(120)


def _value(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[-1])
    return total


def test_dropped_stream_is_counted_as_abort_with_its_tokens() -> None:
    async def main() -> None:
        llm = echo_async_llm(step_delay_ms=30)
        port = free_port()
        runner = web.AppRunner(build_app(llm, ServerSettings(port=port), "echo"))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "echo", "prompt": "abcdef", "max_tokens": 50, "stream": True}
                async with s.post(base + "/v1/completions", json=body) as resp:
                    chunks = 0
                    async for line in resp.content:
                        chunks += line.startswith(b"data:")
                        if chunks >= 3:
                            resp.close()
                            break
                done = {"model": "echo", "prompt": "xy", "max_tokens": 4}
                async with s.post(base + "/v1/completions", json=done) as resp:
                    assert resp.status == 200
                for _ in range(100):
                    if llm.num_in_flight == 0:
                        break
                    await asyncio.sleep(0.02)
                async with s.get(base + "/metrics") as resp:
                    text = await resp.text()
            assert _value(text, "vllm:request_success_total", 'finished_reason="abort"') == 1
            assert _value(text, "vllm:request_success_total", 'finished_reason="length"') == 1
            generated = _value(text, "vllm:generation_tokens_total")
            assert generated >= 4 + 3, text  # the finished request's 4 and the dropped one's >= 3
            assert _value(text, "vllm:prompt_tokens_total") > 0
        finally:
            await runner.cleanup()
            llm.shutdown()

    asyncio.run(main())
