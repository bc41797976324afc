"""Overload soak: `servelab-serve` at a multiple of its capacity for minutes (issue 13, `make soak`).

    python benchmarks/soak.py [--duration-s 600] [--overload 3.0] [--max-pending 64]
        [--layers 2] [--json OUT]

1. Starts `servelab-serve` on 127.0.0.1 (the default model cut to `--layers` layers, so a
   2-core machine reaches a high request rate) with `server.max_pending_requests`.
2. Measures capacity: a closed loop at concurrency 16 for 20 s (completed requests/s).
3. Sends an open-loop Poisson load at `--overload` x that rate for `--duration-s`; every
   request asks 32 tokens, a third of them stream and half of those drop the connection
   after a few chunks. Answers are counted by status: 200, 429 (admission limit, the
   documented overload answer), other 4xx, 5xx, connection errors.
4. Samples the server's and the EngineCore's RSS and open file descriptors every 10 s.
Prints one JSON summary (start / after the first minute / end RSS and fds per process,
counts) and exits 1, each problem named on stderr, if any 5xx came back, the server stopped
answering, a process's RSS grew by more than 3% from the end of the first minute (warm:
allocator pools filled) to the end, or its open files by more than 4 from before the load to
after it (client connections closed). The server's log goes to `<json>.server.log` (or a
temporary file), never to a pipe nobody reads: a full pipe would stall the server's loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

from workloads.sse import aiter_sse

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RSS_GROWTH_MAX = 0.03  # after warm-up, per process
FDS_GROWTH_MAX = 4  # after the load, per process (the client's connections closed)


def start_server(port: int, layers: int, max_pending: int, log: Path, tracemalloc_dir: Path | None = None
                 ) -> subprocess.Popen[bytes]:  # fmt: skip
    args = [sys.executable, "-m", "engine.entrypoints.serve", f"server.port={port}",
            f"model.num_layers_override={layers}", "model.max_model_len=512",
            f"server.max_pending_requests={max_pending}"]  # fmt: skip
    if tracemalloc_dir is not None:
        args.append(f"server.tracemalloc_dir={tracemalloc_dir.resolve()}")
    with log.open("wb") as out:
        return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=out)


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise SystemExit(f"servelab-serve exited with {proc.returncode}")
            try:
                async with s.get(url + "/v1/models") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit("servelab-serve did not become ready")


def sample(pid: int) -> dict[str, dict[str, float]]:
    """RSS (MiB; `anon_mib`: without file-backed and shared pages) and open fds of the server and
    each child (the EngineCore)."""
    out = {}
    root = psutil.Process(pid)
    for i, p in enumerate([root, *root.children(recursive=True)]):
        try:
            mem = p.memory_info()
            out["server" if i == 0 else f"child{i}"] = {"rss_mib": mem.rss / 2**20,
                                                        "anon_mib": (mem.rss - mem.shared) / 2**20, "fds": p.num_fds()}
        except psutil.Error:
            continue
    return out


async def one_request(s: aiohttp.ClientSession, url: str, rng: random.Random, counts: Counter[str]) -> None:
    stream = rng.random() < 1 / 3
    drop = stream and rng.random() < 0.5
    body = {"prompt": f"Request {rng.random():.6f}: tell me a story.", "max_tokens": 32, "ignore_eos": True,
            "stream": stream}
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                counts["429" if r.status == 429 else ("5xx" if r.status >= 500 else "4xx")] += 1
                return
            if not stream:
                await r.read()
            else:
                n = 0
                async for event in aiter_sse(r.content.iter_any()):
                    n += 1
                    if drop and n >= 3:
                        r.close()
                        counts["dropped"] += 1
                        return
                    if '"error"' in event.data:
                        counts["stream_error"] += 1
            counts["200"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError):
        counts["conn_error"] += 1


async def capacity(url: str, seconds: float = 20.0, concurrency: int = 16) -> float:
    counts: Counter[str] = Counter()
    rng = random.Random(0)
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:

        async def loop() -> None:
            while time.monotonic() < stop:
                await one_request(s, url, rng, counts)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return counts["200"] / seconds


async def soak(url: str, pid: int, rate: float, duration_s: float) -> dict[str, object]:
    counts: Counter[str] = Counter()
    rng = random.Random(1)
    samples: list[tuple[float, dict[str, dict[str, float]]]] = [(0.0, sample(pid))]
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    next_sample = 10.0
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        t = 0.0
        while t < duration_s:
            t += rng.expovariate(rate)
            delay = t0 + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one_request(s, url, rng, counts))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            counts["sent"] += 1
            if t >= next_sample:
                samples.append((t, sample(pid)))
                next_sample += 10.0
                rss = " ".join(f"{k}={v['rss_mib']:.0f}MiB/{v['fds']:.0f}fd" for k, v in samples[-1][1].items())
                print(f"  t={t:5.0f}s sent={counts['sent']} ok={counts['200']} 429={counts['429']} "
                      f"5xx={counts['5xx']} in flight={len(tasks)} {rss}", flush=True)  # fmt: skip
        await asyncio.gather(*tasks)
    # The client's keep-alive sockets are closed now: once the server has closed its ends (up to
    # 15 s on a loaded machine), what stays open is its own.
    before = samples[0][1]
    for _ in range(30):
        await asyncio.sleep(0.5)
        after = sample(pid)
        if all(after.get(k, v)["fds"] <= v["fds"] + FDS_GROWTH_MAX for k, v in before.items()):
            break
    samples.append((time.monotonic() - t0, after))
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "ok?", "max_tokens": 2}) as r:
        alive = r.status == 200
    return {"counts": dict(counts), "samples": samples, "alive_after": alive}


def verdict(result: dict[str, object], duration_s: float) -> list[str]:
    problems = []
    counts = result["counts"]
    assert isinstance(counts, dict)
    if counts.get("5xx"):
        problems.append(f"{counts['5xx']} answers were 5xx")
    if not result["alive_after"]:
        problems.append("the server did not answer a request after the soak")
    samples = result["samples"]
    assert isinstance(samples, list)
    # RSS: after the first minute (warm: allocator pools filled) against the end; open files:
    # before the load against after it (both with no client connected).
    warm = next((s for t, s in samples if t >= min(60.0, duration_s / 4)), samples[0][1])
    first, last = samples[0][1], samples[-1][1]
    for proc in first:
        if proc not in last or proc not in warm:
            continue
        rss0, rss1 = warm[proc]["rss_mib"], last[proc]["rss_mib"]
        fd0, fd1 = first[proc]["fds"], last[proc]["fds"]
        if rss1 > (1 + RSS_GROWTH_MAX) * rss0:
            problems.append(f"{proc}: RSS grew {rss0:.1f} -> {rss1:.1f} MiB after warm-up "
                            f"({100 * (rss1 / rss0 - 1):+.1f}%, limit +{100 * RSS_GROWTH_MAX:.0f}%)")
        if fd1 > fd0 + FDS_GROWTH_MAX:
            problems.append(f"{proc}: open files grew {fd0:.0f} -> {fd1:.0f} after the load (limit +{FDS_GROWTH_MAX})")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--overload", type=float, default=3.0, help="offered load as a multiple of capacity")
    p.add_argument("--max-pending", type=int, default=64, help="server.max_pending_requests")
    p.add_argument("--layers", type=int, default=2, help="model.num_layers_override")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tracemalloc", type=Path, default=None, metavar="DIR",
                   help="server.tracemalloc_dir: trace the API server's memory into DIR (slows it; not for figures)")
    a = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        log = a.json.with_suffix(".server.log")
    else:
        log = Path(tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
    print(f"server log: {log}")
    proc = start_server(port, a.layers, a.max_pending, log, a.tracemalloc)
    try:
        asyncio.run(wait_ready(url, proc))
        cap = asyncio.run(capacity(url))
        rate = a.overload * cap
        print(f"capacity {cap:.2f} req/s (closed loop, 16 clients); offering {rate:.2f} req/s for {a.duration_s:.0f} s")
        result = asyncio.run(soak(url, proc.pid, rate, a.duration_s))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    problems = verdict(result, a.duration_s)
    samples = result["samples"]
    assert isinstance(samples, list)
    warm = next((s for t, s in samples if t >= min(60.0, a.duration_s / 4)), samples[0][1])
    summary = {"capacity_rps": cap, "offered_rps": rate, "duration_s": a.duration_s, **result,
               "start": samples[0][1], "after_first_minute": warm, "end": samples[-1][1], "problems": problems,
               "server_exit_code": proc.returncode}  # fmt: skip
    summary.pop("samples")
    print(json.dumps(summary, indent=2))
    if a.json:
        a.json.write_text(json.dumps({**summary, "samples": samples}, indent=2))
    for line in problems:
        print("FAIL:", line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
