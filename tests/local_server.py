"""Helpers for the aiohttp servers tests start on 127.0.0.1: serve an app on a free port, write one
server-sent event."""

from __future__ import annotations

import json

from aiohttp import web


async def serve_locally(app: web.Application, access_log: bool = True) -> tuple[web.AppRunner, int]:
    """`app` served on a free port of 127.0.0.1: its runner (`await runner.cleanup()` stops it) and
    the port."""
    runner = web.AppRunner(app) if access_log else web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def sse_event(resp: web.StreamResponse, obj: dict) -> None:
    """One `data:` event of a server-sent event stream, the object as JSON."""
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())
