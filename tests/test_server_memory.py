"""The API server keeps nothing per step or per request once requests are over (issue 60, item 9).

Under a 10-minute overload the server's RSS rose 12%: `AsyncLLM` kept every step's `StepStats`
in a buffer (up to 100,000) that only the in-process workbench target ever drained. These
tests drive the real app over the echo engine with the soak's traffic mix (finished requests,
streams dropped by their clients, requests refused with 429) and check that afterwards no step
is held by the engine front end, every per-request map is empty, no task is left, and a dropped
stream logs nothing. The memory tracer (`server.tracemalloc_dir`) is checked at the end.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import tracemalloc
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from server_utils import echo_async_llm, free_port

from engine.entrypoints.api_server import ServerSettings, build_app
from engine.entrypoints.memtrace import MemoryTracer, top_tracebacks
from engine.seam import StepStats

pytestmark = pytest.mark.timeout(180)


async def _one(s: aiohttp.ClientSession, url: str, rng: random.Random, counts: Counter[str]) -> None:
    stream = rng.random() < 0.5
    drop = stream and rng.random() < 0.5
    body = {"model": "echo", "prompt": f"r{rng.random():.6f}", "max_tokens": 24, "stream": stream}
    async with s.post(url, json=body) as r:
        if r.status != 200:
            await r.read()
            counts[str(r.status)] += 1
            return
        if not drop:
            await r.read()
            counts["200"] += 1
            return
        n = 0
        async for line in r.content:
            n += line.startswith(b"data:")
            if n >= 3:
                r.close()
                counts["dropped"] += 1
                return


def test_no_step_or_request_state_is_left_after_overload(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)

    async def main() -> None:
        llm = echo_async_llm(step_delay_ms=5)
        seen: list[StepStats] = []
        llm.step_listeners.append(seen.append)
        port = free_port()
        app = build_app(llm, ServerSettings(port=port, max_pending_requests=8), "echo")
        runner = web.AppRunner(app, handler_cancellation=True)  # as servelab-serve runs it
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/completions"
        counts: Counter[str] = Counter()
        rng = random.Random(7)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                tasks = []
                for _ in range(120):  # ~4x what 8 pending requests of 24 tokens at 5 ms a step serve
                    tasks.append(asyncio.create_task(_one(s, url, rng, counts)))
                    await asyncio.sleep(rng.expovariate(80.0))
                await asyncio.gather(*tasks)
            for _ in range(250):  # closed connections and aborts settle asynchronously
                if llm.num_in_flight == 0 and len(llm.output_processor) == 0 and len(asyncio.all_tasks()) <= 3:
                    break
                await asyncio.sleep(0.02)
            assert counts["200"] and counts["429"] and counts["dropped"], counts
            assert llm.num_in_flight == 0 and len(llm.output_processor) == 0
            # Only the engine client's output reader and watchdog, and this test, are left.
            assert len(asyncio.all_tasks()) <= 3, asyncio.all_tasks()
            gc.collect()
            assert len(seen) > 50
            tail = seen[-50:]
            for stats in tail:
                holders = [r for r in gc.get_referrers(stats) if r is not seen and r is not tail]
                assert not holders, f"a StepStats is still held by {type(holders[0]).__name__}"
        finally:
            await runner.cleanup()
            llm.shutdown()

    asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]  # no traceback per dropped stream


def test_memory_tracer_writes_samples_and_snapshots(tmp_path: Path) -> None:
    async def main() -> None:
        tracer = MemoryTracer(tmp_path / "trace", interval_s=30.0, baseline_after_s=0.0)
        tracer.start()
        try:
            first = tracer.sample()
            kept = [bytearray(1000) for _ in range(500)]  # ~0.5 MB that stays alive
            second = tracer.sample()
            assert kept
        finally:
            tracer.close()
        assert not tracemalloc.is_tracing()
        assert first["growth"] == [] and first["rss_mib"] > 0
        grown = {g["site"]: g for g in second["growth"]}
        here = next(g for site, g in grown.items() if site.startswith(__file__))
        assert here["kib"] >= 480 and here["count"] >= 500
        lines = (tmp_path / "trace" / "memtrace.jsonl").read_text().splitlines()
        assert len(lines) == 3  # two samples and the last one at close
        assert {"t_s", "rss_mib", "traced_mib", "malloc", "tasks", "growth"} <= set(json.loads(lines[0]))
        blocks = top_tracebacks(tmp_path / "trace" / "baseline.snapshot", tmp_path / "trace" / "final.snapshot")
        assert blocks and all("KiB" in b for b in blocks)

    asyncio.run(main())


def test_memory_tracer_names_a_folder_it_cannot_create(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="server.tracemalloc_dir: cannot create"):
        MemoryTracer(blocker / "trace")
