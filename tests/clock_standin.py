"""A stand-in OpenAI completions server whose timing is known: it answers every streamed request with
its first token `--first-ms` after the request arrived and one more every `--itl-ms`, `max_tokens`
in all, each chunk carrying its cumulative usage, then the final usage and `[DONE]`. GET /metrics and
/v1/models answer as a server would. It prints its port on the first line of stdout.

A client's clock is checked against it (tests/test_client_clock.py): a TTFT below `--first-ms` means
the clock started after the request was sent; one far above it is the client's own delay.

    python tests/clock_standin.py [--first-ms 200] [--itl-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web
from local_server import serve_locally, sse_event

FIRST_S = web.AppKey("first_s", float)
ITL_S = web.AppKey("itl_s", float)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    prompt = body.get("prompt")
    n_in = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(request.app[FIRST_S])
    for i in range(n):
        if i:
            await asyncio.sleep(request.app[ITL_S])
        choice = {"index": 0, "text": " x", "finish_reason": "length" if i == n - 1 else None}
        await sse_event(resp, {"choices": [choice], "usage": {"prompt_tokens": n_in, "completion_tokens": i + 1}})
    await sse_event(resp, {"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n,
                                                 "total_tokens": n_in + n}})  # fmt: skip
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(text="vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n")


async def main(first_ms: float, itl_ms: float) -> None:
    app = web.Application()
    app[FIRST_S], app[ITL_S] = first_ms / 1000, itl_ms / 1000
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    _runner, port = await serve_locally(app, access_log=False)
    print(port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--first-ms", type=float, default=200.0, help="delay from a request to its first token")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="delay between further tokens")
    args = ap.parse_args()
    asyncio.run(main(args.first_ms, args.itl_ms))
