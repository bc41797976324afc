"""What the HTTP server adds to latency: one streamed request, server vs in-process engine.

    python benchmarks/serving_overhead.py [--repeats 5] [--max-tokens 32] [hydra overrides...]

Same run, same model (default smollm2), same greedy request with ignore_eos:
1. through `servelab-serve` (a subprocess; HTTP + SSE + ZMQ to the EngineCore process),
   timed by an aiohttp client: TTFT = first content chunk - send, ITL = gaps between chunks
   (one token per chunk here);
2. through `AsyncLLM(multiprocess=False)` in this process: TTFT = first output - call,
   ITL = gaps between outputs.
The two phases run one after the other, never at once, so they do not share the CPU.
Target: the server adds <= 3 ms to median TTFT and <= 1 ms to median ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_utils import start_server  # noqa: E402

from engine.entrypoints.serve import load_config  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def _server_runs(url: str, max_tokens: int, n: int) -> list[tuple[float, list[float]]]:
    """n streamed requests over one keep-alive connection (connection set-up is not the server's)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    runs = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            times = []
            async with s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        times.append(time.perf_counter())
            runs.append((times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)]))
    return runs


async def _inprocess_once(llm, max_tokens: int) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    times = []
    async for out in llm.generate(PROMPT, params):
        if out.outputs[0].text_delta:
            times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)]


def _summarize(runs: list[tuple[float, list[float]]]) -> tuple[float, float]:
    ttft = statistics.median(r[0] for r in runs[1:])  # the first run is warm-up
    itl = statistics.median(g for r in runs[1:] for g in r[1])
    return ttft * 1000, itl * 1000


def bench_server(overrides: list[str], repeats: int, max_tokens: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), *overrides, ready_timeout_s=600)
        try:
            runs = asyncio.run(_server_runs(server.base_url, max_tokens, repeats + 1))
        finally:
            server.stop()
    return _summarize(runs)


def bench_inprocess(overrides: list[str], repeats: int, max_tokens: int) -> tuple[float, float]:
    from engine.async_llm import AsyncLLM

    engine_config, _ = load_config(overrides)

    async def go() -> list[tuple[float, list[float]]]:
        llm = AsyncLLM.from_config(engine_config, multiprocess=False)
        try:
            return [await _inprocess_once(llm, max_tokens) for _ in range(repeats + 1)]
        finally:
            llm.shutdown()

    return _summarize(asyncio.run(go()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    args, overrides = ap.parse_known_args()
    srv = bench_server(overrides, args.repeats, args.max_tokens)
    inp = bench_inprocess(overrides, args.repeats, args.max_tokens)
    print(f"one streamed request, prompt {len(PROMPT)} chars, {args.max_tokens} tokens, "
          f"median of {args.repeats} runs after 1 warm-up")
    print(f"{'path':<22}{'TTFT ms':>10}{'ITL ms':>10}")
    print(f"{'http server':<22}{srv[0]:>10.2f}{srv[1]:>10.2f}")
    print(f"{'in-process AsyncLLM':<22}{inp[0]:>10.2f}{inp[1]:>10.2f}")
    d_ttft, d_itl = srv[0] - inp[0], srv[1] - inp[1]
    print(f"{'server adds':<22}{d_ttft:>10.2f}{d_itl:>10.2f}")
    ok = d_ttft <= 3.0 and d_itl <= 1.0
    print(f"target: TTFT +<=3 ms, ITL +<=1 ms -> {'MET' if ok else 'NOT MET'}")


if __name__ == "__main__":
    main()
