"""What the HTTP server adds to latency: one streamed request, server vs in-process engine.

    python benchmarks/serving_overhead.py [--rounds 10] [--max-tokens 32] [hydra overrides...]

Same run, same model (default smollm2), same greedy request with ignore_eos:
1. through `servelab-serve` (a subprocess; HTTP + SSE + ZMQ to the EngineCore process),
   timed by an aiohttp client: TTFT = first content chunk - send, ITL = gaps between chunks
   (one token per chunk here);
2. through `AsyncLLM(multiprocess=False)` in this process: TTFT = first output - call,
   ITL = gaps between outputs.
Both are up at once but never busy at once: requests alternate between the two paths, so
slow drifts of a shared machine hit both. Both use the engine threads the server would use
(on a CPU, every core: see serving_defaults in engine/entrypoints/serve.py).
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

from workloads.serve import load_config  # noqa: E402
from workloads.sse import DONE as SSE_DONE  # noqa: E402
from workloads.sse import aiter_sse  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def _server_once(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float, list[float]]:
    """One streamed request over a keep-alive connection (connection set-up is not the server's)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        async for event in aiter_sse(r.content.iter_any()):
            if event.data != SSE_DONE and json.loads(event.data)["choices"][0]["text"]:
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)]


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
    ttft = statistics.median(r[0] for r in runs)
    itl = statistics.median(g for r in runs for g in r[1])
    return ttft * 1000, itl * 1000


def _paired(srv: list[tuple[float, list[float]]], inp: list[tuple[float, list[float]]]) -> tuple[float, float]:
    """Median over rounds of (server - in-process) for TTFT and for the round's median ITL (ms)."""
    d_ttft = statistics.median(a[0] - b[0] for a, b in zip(srv, inp, strict=True))
    d_itl = statistics.median(statistics.median(a[1]) - statistics.median(b[1]) for a, b in zip(srv, inp, strict=True))
    return d_ttft * 1000, d_itl * 1000


def bench(overrides: list[str], rounds: int, max_tokens: int) -> tuple[tuple[float, float], tuple[float, float],
                                                                        tuple[float, float], int]:
    """Both paths up at once (each idle while the other runs), requests alternating between
    them for `rounds` rounds after one warm-up round: slow drifts of a shared machine hit both."""
    from engine.frontend.async_llm import AsyncLLM

    engine_config, _ = load_config(overrides)  # the server's own rule for engine threads
    threads = engine_config.device.num_threads

    async def go(url: str) -> tuple[list, list]:
        llm = AsyncLLM.from_config(engine_config, multiprocess=False)
        srv_runs, inp_runs = [], []
        try:
            async with aiohttp.ClientSession() as session:
                for i in range(rounds + 1):
                    a = await _server_once(session, url, max_tokens)
                    b = await _inprocess_once(llm, max_tokens)
                    if i:  # round 0 is warm-up
                        srv_runs.append(a)
                        inp_runs.append(b)
        finally:
            llm.shutdown()
        return srv_runs, inp_runs

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), *overrides, ready_timeout_s=600, omp_threads=None)  # the server picks its threads
        try:
            srv, inp = asyncio.run(go(server.base_url))
        finally:
            server.stop()
    return _summarize(srv), _summarize(inp), _paired(srv, inp), threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    args, overrides = ap.parse_known_args()
    srv, inp, (d_ttft, d_itl), threads = bench(overrides, args.rounds, args.max_tokens)
    print(f"one streamed request, prompt {len(PROMPT)} chars, {args.max_tokens} tokens, engine threads "
          f"{threads or 'torch default'}; {args.rounds} rounds alternating server / in-process after 1 warm-up")
    print(f"{'path':<22}{'TTFT ms':>10}{'ITL ms':>10}")
    print(f"{'http server':<22}{srv[0]:>10.2f}{srv[1]:>10.2f}")
    print(f"{'in-process AsyncLLM':<22}{inp[0]:>10.2f}{inp[1]:>10.2f}")
    print(f"{'difference of medians':<22}{srv[0] - inp[0]:>10.2f}{srv[1] - inp[1]:>10.2f}")
    print(f"{'server adds (paired)':<22}{d_ttft:>10.2f}{d_itl:>10.2f}   median over rounds of server - in-process")
    ok = d_ttft <= 3.0 and d_itl <= 1.0
    print(f"target: TTFT +<=3 ms, ITL +<=1 ms -> {'MET' if ok else 'NOT MET'}")


if __name__ == "__main__":
    main()
