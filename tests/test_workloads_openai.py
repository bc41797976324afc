"""OpenAITarget against a fake OpenAI server (aiohttp): SSE, include_usage, multi-token chunks."""

import asyncio
import json

import pytest
from aiohttp import web
from local_server import serve_locally, sse_event

from analysis.metrics import summarize
from workloads.driver import run_workload
from workloads.spec import RequestSpec
from workloads.targets.openai import OpenAITarget, parse_gauges, reconcile_counts

# (text, cumulative completion tokens) per chunk; the 2nd chunk carries 2 tokens, the 3rd is
# a partial character (no text) whose token belongs to the 4th.
CHUNKS = [("Hello", 1), (" big world", 3), ("", 4), ("!", 5)]
GAP = 0.03
BODIES = web.AppKey("bodies", list)
CONTINUOUS = web.AppKey("continuous", bool)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    if body.get("max_tokens", 0) > 100:
        return web.json_response({"error": {"message": "too long", "type": "BadRequest"}}, status=400)
    continuous = request.app[CONTINUOUS]
    chat = request.path.endswith("chat/completions")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if chat:
        await sse_event(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for i, (text, cum) in enumerate(CHUNKS):
        await asyncio.sleep(GAP)
        choice = {"index": 0, "finish_reason": "length" if i == len(CHUNKS) - 1 else None}
        choice |= {"delta": {"content": text}} if chat else {"text": text}
        usage = {"prompt_tokens": 7, "completion_tokens": cum} if continuous else None
        await sse_event(resp, {"choices": [choice], "usage": usage})
    await sse_event(resp, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}})
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text='# HELP x\nvllm:num_requests_running{model="m"} 3.0\n'
                             'vllm:num_requests_waiting{model="m"} 1.0\nvllm:kv_cache_usage_perc 0.25\n')


async def _serve_and_run(continuous: bool, endpoint: str, specs: list[RequestSpec]):
    app = web.Application()
    app[BODIES], app[CONTINUOUS] = [], continuous
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/metrics", _metrics)
    runner, port = await serve_locally(app)
    try:
        tgt = OpenAITarget(f"http://127.0.0.1:{port}", "m", api_key="k", endpoint=endpoint)
        result = await run_workload(specs, tgt)
        await tgt.start()
        gauges = await tgt.scrape_metrics()
        await tgt.stop()
    finally:
        await runner.cleanup()
    return result, app[BODIES], gauges


def _spec(rid: str, max_tokens: int = 5, text: bool = True) -> RequestSpec:
    return RequestSpec(rid, 0.0, "Hi there" if text else None, None if text else [1, 2, 3], 3, max_tokens)


def test_completions_stream_with_continuous_usage():
    result, bodies, gauges = asyncio.run(_serve_and_run(True, "completions", [_spec("a", text=False)]))
    body = bodies[0]
    assert body["stream"] and body["stream_options"]["include_usage"] and body["prompt"] == [1, 2, 3]
    assert body["ignore_eos"] is True and body["model"] == "m"
    (rec,) = result.records
    assert rec.ok and rec.output_tokens == 5 and rec.prompt_tokens == 7 and rec.finish_reason == "length"
    assert rec.output_text == "Hello big world!"
    tt = rec.token_times
    assert len(tt) == 5 and tt[0] < tt[1] < tt[2] < tt[3] < tt[4]
    # chunk 2 carries 2 tokens: its gap is split in two equal ITLs
    assert rec.itls_per_token_s[0] == pytest.approx(rec.itls_per_token_s[1])
    # the text-less chunk's token arrives with "!": 2 tokens over ~2 gaps
    assert tt[4] - tt[2] > 1.5 * GAP
    assert rec.itls_per_token_s[2] == pytest.approx(rec.itls_per_token_s[3])
    s = summarize(result.records)
    assert s["total_output_tokens"] == 5 and s["mean_tpot_ms"] == pytest.approx(s["mean_itl_per_token_ms"])
    assert gauges == {"num_running": 3.0, "num_waiting": 1.0, "kv_usage": 0.25}


def test_chat_stream_without_per_chunk_usage_spreads_the_total():
    result, bodies, _ = asyncio.run(_serve_and_run(False, "chat", [_spec("c")]))
    assert bodies[0]["messages"] == [{"role": "user", "content": "Hi there"}]
    (rec,) = result.records
    assert rec.ok and rec.output_tokens == 5 and len(rec.token_times) == 5  # 3 content chunks: 2, 2, 1
    assert rec.ttft_s >= GAP * 0.9  # the role-only first delta is not content


def test_http_error_is_a_failed_request():
    result, _, _ = asyncio.run(_serve_and_run(True, "completions", [_spec("e", max_tokens=500)]))
    (rec,) = result.records
    assert not rec.ok and rec.error.startswith("HTTP 400") and "too long" in rec.error
    assert summarize(result.records)["failed"] == 1


def test_reconcile_counts_and_gauges():
    assert reconcile_counts([None, None, None], 7) == [3, 2, 2]
    assert reconcile_counts([1, None], None) == [1, 1]
    assert reconcile_counts([1, 2], 4, leftover=1) == [1, 3]
    assert parse_gauges("servelab:num_requests_waiting 2\n") == {"num_waiting": 2.0}


def test_parse_gauges_never_adds_aliases_of_one_figure() -> None:
    """vLLM exports the KV usage under two names; reading both must not double it (issue 13, defect 5)."""
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:num_requests_running{engine="0"} 3\n'
        'vllm:num_requests_running{engine="1"} 2\n'
    )
    assert parse_gauges(text) == {"kv_usage": 0.25, "num_running": 5.0}
    assert parse_gauges('vllm:gpu_cache_usage_perc{engine="0"} 0.5\n') == {"kv_usage": 0.5}


async def _spec_stream(request: web.Request) -> web.StreamResponse:
    """A stream only a parser that follows the SSE standard reads: CRLF line ends, a comment,
    an event whose JSON is spread over two `data` lines, and writes cut inside lines and CRLFs."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    usage = '"usage": {"prompt_tokens": 7, "completion_tokens": 2}'
    raw = (": keep-alive\r\n\r\n"
           'data: {"choices": [{"index": 0, "text": "Hel",\r\ndata:  "finish_reason": null}]}\r\n\r\n'
           'event: message\r\ndata: {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}],\r\n'
           f"data: {usage}}}\r\n\r\ndata: [DONE]\r\n\r\n").encode()  # fmt: skip
    # cut inside the comment, between the CR and the LF ending the first data line, and
    # inside the second event's text
    cuts = [0, 5, raw.index(b"\r\ndata:  ") + 1, raw.index(b'"lo"') + 2, len(raw)]
    for a, b in zip(cuts, cuts[1:], strict=False):
        await resp.write(raw[a:b])
        await asyncio.sleep(0.01)
    return resp


def test_sse_multi_line_events_comments_and_crlf_split_across_writes() -> None:
    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", _spec_stream)
        runner, port = await serve_locally(app)
        try:
            return await run_workload([_spec("s")], OpenAITarget(f"http://127.0.0.1:{port}", "m"))
        finally:
            await runner.cleanup()

    (rec,) = asyncio.run(run()).records
    assert rec.ok, rec.error
    assert rec.output_text == "Hello" and rec.finish_reason == "length" and rec.output_tokens == 2


async def _raw_sse_server(drop: str) -> tuple[asyncio.AbstractServer, int, list[int]]:
    """A raw HTTP/1.1 server answering each POST with a whole SSE body on a kept-alive connection. `drop`:
    "second" closes the first connection when its second request arrives (as a server closing an idle kept-alive
    connection does, seen from the client), "all" closes every connection on its first request. The list counts
    the requests each connection received."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(seen)
        seen.append(0)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))  # fmt: skip
                await reader.readexactly(length)
                seen[index] += 1
                if drop == "all" or (drop == "second" and index == 0 and seen[index] == 2):
                    break
                events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": i + 1}}
                          for i, t in enumerate(["a", "b"])]  # fmt: skip
                body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def test_a_request_written_into_a_closed_kept_alive_connection_is_sent_again_once_and_counted() -> None:
    """llama-server closed kept-alive connections under the workbench (issue 55: 1-4 of 64 requests a round
    ended "Server disconnected" though the server never saw them). Such a request goes out again once on a fresh
    connection, counted in `reconnects` / `client_reconnects`; a server that drops everything still fails it."""

    async def main(drop: str) -> tuple[list, list[int]]:
        server, port, seen = await _raw_sse_server(drop)
        target = OpenAITarget(base_url=f"http://127.0.0.1:{port}", model="m")
        await target.start()
        try:
            results = [await target.send(RequestSpec(f"r{i}", 0.0, "hi", None, 1, 2)) for i in range(3)]
        finally:
            await target.stop()
            server.close()
        return results, seen

    results, seen = asyncio.run(main("second"))
    assert [r.error for r in results] == ["", "", ""]
    assert [r.reconnects for r in results] == [0, 1, 0]
    assert seen == [2, 2]  # the dropped request reached the first connection, then the second served it
    assert all(r.output_tokens == 2 for r in results)

    failed, seen = asyncio.run(main("all"))
    assert all("ServerDisconnected" in r.error and r.reconnects == 1 for r in failed)
    assert seen == [1] * 6  # each request tried twice, never more

    from workloads.record_builder import build_record

    spec = RequestSpec("x", 0.0, "hi", None, 1, 2)
    recs = [build_record(spec, scheduled_s=0.0, start_s=0.0, token_times=[0.1, 0.2], done_s=0.2, reconnects=n)
            for n in (0, 1, 1)]  # fmt: skip
    assert summarize(recs)["client_reconnects"] == 2
