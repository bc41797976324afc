"""Faults under load against a live `servelab-serve` (issue 13, item 4).

- half of 16 streaming clients drop their connections mid-stream: the rest finish, and the
  KV cache and the running count are back to zero right after the last request ends;
- slow-loris clients (headers dribbled a byte at a time) cannot hold the server: good
  requests are answered meanwhile;
- the EngineCore killed while 12 requests are in flight: every one fails fast with an error,
  `/health` answers 503, and once the server stops no process of it is left.

Dummy weights with two layers keep start-up short; none of this depends on what the model says.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest
from server_utils import ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]
BODY = {"prompt": "Hello there", "max_tokens": 400, "ignore_eos": True, "stream": True}


def _start(tmp: Path) -> ServerProcess:
    return start_server(
        tmp, "model.load_format=dummy", "model.num_layers_override=2", "model.max_model_len=512",
        "scheduler.step_delay_ms=5",
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = _start(tmp_path_factory.mktemp("faults"))
    yield proc
    assert proc.stop() == 0, proc.log()


def _gauge(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[-1])
    return total


async def _engine_gauges(s: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return _gauge(text, "vllm:num_requests_running"), _gauge(text, "vllm:kv_cache_usage_perc")


def test_dropped_streams_free_their_kv(server: ServerProcess) -> None:
    async def go() -> None:
        url = server.base_url
        async with aiohttp.ClientSession() as s:
            keep_body = {**BODY, "max_tokens": 40}

            async def client(drop: bool) -> int:
                async with s.post(url + "/v1/completions", json=BODY if drop else keep_body) as resp:
                    n = 0
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            n += 1
                        if drop and n >= 3:
                            resp.close()  # the connection goes away mid-stream
                            return n
                    return n

            counts = await asyncio.gather(*(client(drop=i % 2 == 0) for i in range(16)))
            assert all(c >= 3 for c in counts), counts
            deadline = time.monotonic() + 5.0
            while True:
                running, kv = await _engine_gauges(s, url)
                if running == 0 and kv == 0:
                    break
                assert time.monotonic() < deadline, f"still running={running} kv={kv} after the last drop"
                await asyncio.sleep(0.05)

    asyncio.run(go())


def test_slow_loris_clients_cannot_hold_the_server(server: ServerProcess) -> None:
    async def go() -> None:
        host, port = "127.0.0.1", server.port
        writers = []
        for _ in range(64):
            _, w = await asyncio.open_connection(host, port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            writers.append(w)
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    for w in writers:
                        if not w.is_closing():
                            w.write(b"X")  # one more header byte each, never the end of the headers
                    body = {"prompt": "Hi", "max_tokens": 4}
                    async with s.post(server.base_url + "/v1/completions", json=body,
                                      timeout=aiohttp.ClientTimeout(total=30)) as r:
                        assert r.status == 200
                        assert (await r.json())["choices"][0]["text"] is not None
                    await asyncio.sleep(0.2)
        finally:
            for w in writers:
                w.close()

    asyncio.run(go())


def test_engine_killed_under_load_fails_every_request_and_leaves_no_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = _start(tmp_path_factory.mktemp("kill"))
    tree = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(recursive=True))]

    async def go() -> float:
        url = server.base_url
        async with aiohttp.ClientSession() as s:

            async def client() -> list[bytes]:
                async with s.post(url + "/v1/completions", json=BODY) as resp:
                    return [line async for line in resp.content if line.strip()]

            tasks = [asyncio.create_task(client()) for _ in range(12)]
            deadline = time.monotonic() + 60
            seen = 0.0
            while (running := (await _engine_gauges(s, url))[0]) < 12:
                seen = max(seen, running)
                assert time.monotonic() < deadline, (
                    f"the load never reached 12 running requests (at most {seen:g});\n{server.log()[-3000:]}"
                )
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()][:1]
                await asyncio.sleep(0.05)
            kids = psutil.Process(server.proc.pid).children()
            core = next(k for k in kids if "spawn_main" in " ".join(k.cmdline()))
            os.kill(core.pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            elapsed = time.monotonic() - t0
            for events in results:
                assert b'"error"' in events[-2] and events[-1].strip() == b"data: [DONE]", events[-3:]
            async with s.get(url + "/health") as r:
                assert r.status == 503
            return elapsed

    try:
        elapsed = asyncio.run(go())
    except BaseException:
        server.stop()  # a failed check must not leave the server (and its EngineCore) running
        raise
    assert elapsed < 5.0, f"in-flight requests took {elapsed:.2f} s to fail"  # ~0.1 s when the machine is idle
    assert server.stop() == 0, server.log()
    # Helpers of the server (multiprocessing's resource tracker) exit when they read EOF from the
    # server's pipe; on a loaded machine that can take a moment after the server itself is gone.
    procs = []
    for pid in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=15)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append((p.pid, " ".join(p.cmdline())))
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind 15 s after the server stopped: {left}"
