"""A minimal streaming client that measures the way `vllm bench serve` does (its
`async_request_openai_completions`), to hold the workbench's client clock against.

One aiohttp session, a semaphore for the concurrency; per request: `start = perf_counter()` just
before the POST, TTFT at the first SSE line whose text is not empty, an ITL per further content
line, the latency at the last one. Nothing else runs in its event loop.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class MinimalResult:
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> MinimalResult:
    out = MinimalResult()
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    out.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                choices = data.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if out.ttft_s == 0.0:
                        out.ttft_s = now - start
                    else:
                        out.itls_s.append(now - last)
                    last = now
            out.latency_s = last - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run_minimal(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                      concurrency: int) -> list[MinimalResult]:
    """Every prompt (token ids) streamed greedily with EOS ignored, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        async def limited(prompt: list[int]) -> MinimalResult:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
            async with sem:
                return await _one(session, f"{base_url}/v1/completions", body)

        return list(await asyncio.gather(*(limited(p) for p in prompts)))


def median_ttft_ms(results: list[MinimalResult]) -> float:
    return 1000 * statistics.median(r.ttft_s for r in results if not r.error)
