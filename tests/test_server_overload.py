"""Overload is answered, not queued without bound (issue 13, item 4).

With `server.max_pending_requests=N`, the (N+1)-th concurrent generation request gets 429
with `Retry-After` and an OpenAI error body at once; the admitted ones finish; afterwards
the server admits again. An in-process app over the echo engine, so the test is fast.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from server_utils import echo_async_llm, free_port

from engine.entrypoints.api_server import ServerSettings, build_app

pytestmark = pytest.mark.timeout(120)


def test_requests_over_the_pending_limit_get_429_then_admitted_again() -> None:
    async def main() -> None:
        llm = echo_async_llm(step_delay_ms=40)  # ~40 ms a token: requests stay in flight a while
        port = free_port()
        app = build_app(llm, ServerSettings(port=port, max_pending_requests=2), "echo")
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": "echo", "prompt": "abcd", "max_tokens": 12, "temperature": 0}
        try:
            async with aiohttp.ClientSession() as session:

                async def send() -> tuple[int, dict, str | None]:
                    async with session.post(url, json=body) as resp:
                        return resp.status, json.loads(await resp.read()), resp.headers.get("Retry-After")

                results = await asyncio.gather(*(send() for _ in range(6)))
                statuses = sorted(r[0] for r in results)
                assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
                for status, obj, retry in results:
                    if status == 429:
                        assert retry == "1" and obj["error"]["code"] == "too_many_requests"
                        assert obj["error"]["type"] == "rate_limit_error"
                    else:
                        assert obj["choices"][0]["finish_reason"] == "length"
                assert llm.num_in_flight == 0
                status, obj, _ = await send()
                assert status == 200
        finally:
            await runner.cleanup()
            llm.shutdown()

    asyncio.run(main())
