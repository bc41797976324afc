"""`servelab-router`: prefill/decode disaggregation in front of N prefill and M decode servers.

    servelab-router --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        [--prefill URL ...] [--decode URL ...] [--policy round_robin|least_loaded] [--down-s 5]

Each OpenAI request (`/v1/completions`, `/v1/chat/completions`) goes first to a prefill
instance (`kv_transfer.kv_role=kv_producer`) as a copy with `max_tokens=1` and no streaming:
computing that one token puts the prompt's full KV blocks into the shared store. Then the
original request goes to a decode instance (`kv_role=kv_consumer`), which loads those blocks
through its connector, computes the prompt's tail, and answers; its answer (JSON or the SSE
stream) is passed through unchanged, so every OpenAI client works as with one server.

Failures: a prefill instance that fails only costs the decode instance the recompute (the
request still succeeds). A decode instance that cannot be reached answers 502 with an OpenAI
error body and is left out for `--down-s` seconds; with none left, 503. A stream cut by its
instance ends with an error event. `/v1/models` is a decode instance's; `/health` is 200 while a
decode instance is up; `/metrics` counts requests and errors per instance.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from engine.entrypoints.errors import ApiError

logger = logging.getLogger("servelab.router")

POLICIES = ("round_robin", "least_loaded")
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")


@dataclass
class InstancePool:
    """Instances of one role; `pick` skips those marked down."""

    urls: list[str]
    policy: str = "round_robin"
    down_s: float = 5.0
    in_flight: Counter[str] = field(default_factory=Counter)
    _down_until: dict[str, float] = field(default_factory=dict)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def up(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.urls if self._down_until.get(u, 0.0) <= now]

    def pick(self) -> str | None:
        candidates = self.up()
        if not candidates:
            return None
        if self.policy == "least_loaded":
            return min(candidates, key=lambda u: (self.in_flight[u], self.urls.index(u)))
        return candidates[next(self._rr) % len(candidates)]

    def mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.down_s


class Router:
    def __init__(self, prefill: list[str], decode: list[str], policy: str = "round_robin", down_s: float = 5.0,
                 timeout_s: float = 600.0) -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not decode:
            raise ValueError("at least one --decode instance is needed")
        self.prefill = InstancePool([u.rstrip("/") for u in prefill], policy, down_s)
        self.decode = InstancePool([u.rstrip("/") for u in decode], policy, down_s)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)
        self.session: aiohttp.ClientSession | None = None
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (role, url, outcome)

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    # ---- handlers ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return ApiError(400, "request body is not valid JSON").response()
        if not isinstance(body, dict):
            return ApiError(400, "request body must be a JSON object").response()
        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        refused = await self._prefill(request.path, body, headers)
        if refused is not None:
            return refused
        return await self._decode(request, body, headers)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> web.Response | None:
        """Run the prompt on a prefill instance; a 4xx answer (the request is invalid) is
        returned to the client, any other failure only logged (decode recomputes)."""
        url = self.prefill.pick()
        if url is None:
            return None
        short = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        short["max_tokens"] = 1
        if "max_completion_tokens" in short:
            short["max_completion_tokens"] = 1
        assert self.session is not None
        self.prefill.in_flight[url] += 1
        try:
            async with self.session.post(url + path, json=short, headers=headers) as resp:
                data = await resp.read()
                if 400 <= resp.status < 500:
                    self.counts["prefill", url, "rejected"] += 1
                    return web.Response(body=data, status=resp.status, content_type="application/json")
                self.counts["prefill", url, "ok" if resp.status == 200 else "error"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.prefill.mark_down(url)
            self.counts["prefill", url, "unreachable"] += 1
            logger.warning("prefill instance %s failed (%s); decode recomputes the prompt", url, type(exc).__name__)
        finally:
            self.prefill.in_flight[url] -= 1
        return None

    async def _decode(self, request: web.Request, body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
        url = self.decode.pick()
        if url is None:
            return ApiError(503, "no decode instance is available; retry later").response()
        assert self.session is not None
        self.decode.in_flight[url] += 1
        out: web.StreamResponse | None = None
        try:
            async with self.session.post(url + request.path, json=body, headers=headers) as resp:
                ctype = resp.headers.get("Content-Type", "application/json")
                if not ctype.startswith("text/event-stream"):
                    data = await resp.read()
                    self.counts["decode", url, "ok" if resp.status == 200 else "error"] += 1
                    return web.Response(body=data, status=resp.status, headers={"Content-Type": ctype})
                out = web.StreamResponse(status=resp.status, headers={"Content-Type": ctype,
                                                                        "Cache-Control": "no-cache"})  # fmt: skip
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    if not await _send(out, chunk):
                        break  # the client went away (e.g. it stopped reading after [DONE])
                await _send(out, None)
                self.counts["decode", url, "ok"] += 1
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.decode.mark_down(url)
            self.counts["decode", url, "unreachable"] += 1
            err = ApiError(502, f"decode instance {url} failed: {type(exc).__name__}")
            if out is None:
                return err.response()
            await _send(out, err.sse() + b"data: [DONE]\n\n")  # the stream was cut mid-way
            return out
        finally:
            self.decode.in_flight[url] -= 1

    async def models(self, request: web.Request) -> web.Response:
        url = self.decode.pick()
        if url is None:
            return ApiError(503, "no decode instance is available; retry later").response()
        assert self.session is not None
        try:
            async with self.session.get(url + "/v1/models", headers={
                    h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}) as resp:  # fmt: skip
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.decode.mark_down(url)
            return ApiError(502, f"decode instance {url} failed: {type(exc).__name__}").response()

    async def health(self, request: web.Request) -> web.Response:
        if not self.decode.up():
            return ApiError(503, "no decode instance is available").response()
        return web.json_response({"status": "ok", "prefill": self.prefill.up(), "decode": self.decode.up()})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# HELP servelab_router_requests_total Requests forwarded, by role, instance and outcome.",
                 "# TYPE servelab_router_requests_total counter"]  # fmt: skip
        for (role, url, outcome), n in sorted(self.counts.items()):
            lines.append(f'servelab_router_requests_total{{role="{role}",instance="{url}",outcome="{outcome}"}} {n}')
        lines += ["# HELP servelab_router_in_flight Requests in flight per instance.",
                  "# TYPE servelab_router_in_flight gauge"]  # fmt: skip
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            for url in pool.urls:
                lines.append(f'servelab_router_in_flight{{role="{role}",instance="{url}"}} {pool.in_flight[url]}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def _send(out: web.StreamResponse, data: bytes | None) -> bool:
    """Write to the client (None: end the response); False when the client has gone."""
    try:
        if data is None:
            await out.write_eof()
        else:
            await out.write(data)
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="servelab-router", description="Prefill/decode router (OpenAI API in front).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill (kv_producer) server")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode (kv_consumer) server")
    p.add_argument("--policy", default="round_robin", choices=POLICIES)
    p.add_argument("--down-s", type=float, default=5.0, help="seconds an unreachable instance is left out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        router = Router(args.prefill, args.decode, args.policy, args.down_s)
    except ValueError as exc:
        raise SystemExit(f"servelab-router: {exc}") from None
    web.run_app(router.app(), host=args.host, port=args.port, print=lambda *_: None)


if __name__ == "__main__":
    main()
