"""Killing the EngineCore process under a running server: in-flight requests fail fast,
/health answers 503, new requests get an error at once, and SIGTERM still exits cleanly.

Dummy weights with two layers keep the start-up short; the failure path does not
depend on what the model says.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import psutil
import pytest
from server_utils import ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("server"),
        "model.load_format=dummy",
        "model.num_layers_override=2",
        "scheduler.step_delay_ms=20",
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def _engine_pid(server: ServerProcess) -> int:
    kids = psutil.Process(server.proc.pid).children()
    cores = [k for k in kids if "spawn_main" in " ".join(k.cmdline())]
    assert len(cores) == 1, [k.cmdline() for k in kids]
    return cores[0].pid


def test_killed_engine_fails_in_flight_requests_fast(server: ServerProcess) -> None:
    async def go() -> None:
        url = server.base_url
        body = {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200
            plain = asyncio.create_task(s.post(url + "/v1/completions", json=body))
            async with s.post(url + "/v1/completions", json={**body, "stream": True}) as stream:
                await stream.content.readline()  # streaming: the request is in flight
                os.kill(_engine_pid(server), signal.SIGKILL)
                t0 = time.monotonic()
                events = [line async for line in stream.content if line.strip()]
                assert time.monotonic() - t0 < 2.0
            assert b'"error"' in events[-2] and events[-1].strip() == b"data: [DONE]"
            resp = await asyncio.wait_for(plain, 2.0)
            assert resp.status == 500 and "engine" in (await resp.json())["error"]["message"]
            async with s.get(url + "/health") as r:
                assert r.status == 503 and "error" in await r.json()
            async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 500 and (await r.json())["error"]["code"] == "engine_dead"

    asyncio.run(go())
