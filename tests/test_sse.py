"""workloads/sse.py against the SSE standard's cases: multi-line data, comments, fields,
CRLF / LF / CR line ends, chunks split anywhere (inside a CRLF and inside a UTF-8 character)."""

from __future__ import annotations

import asyncio
import json

from workloads.sse import SSEEvent, SSEParser, aiter_sse

# Two events the old `data:`-line reader got wrong: a JSON object spread over two data lines
# (it parsed each line alone) and a comment plus an event name before a one-line event.
STREAM = (
    ": keep-alive\n"
    'data: {"a":\n'
    "data: 1}\n"
    "\n"
    "event: update\n"
    "id: 7\n"
    "retry: 1500\n"
    "data:no-space \u00e9t\u00e9\n"
    "unknown: ignored\n"
    "\n"
    "data\n"  # a field without a colon: data with an empty value
    "\n"
    "\n"  # a blank line without data dispatches nothing
    "data: [DONE]\n"
    "\n"
    "data: never dispatched (no blank line before the end)"
)
EXPECTED = [
    SSEEvent('{"a":\n1}'),
    SSEEvent("no-space \u00e9t\u00e9", "update", "7", 1500),
    SSEEvent("", "message", "7", 1500),  # id and retry persist; the event type does not
    SSEEvent("[DONE]", "message", "7", 1500),
]


def _parse(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def test_multi_line_data_comments_and_fields() -> None:
    events = _parse([STREAM.encode()])
    assert events == EXPECTED
    assert json.loads(events[0].data) == {"a": 1}


def test_every_line_ending() -> None:
    for eol in ("\r\n", "\r", "\n"):
        assert _parse([STREAM.replace("\n", eol).encode()]) == EXPECTED, repr(eol)


def test_chunks_split_at_every_byte() -> None:
    """Every two-way split, and one byte at a time, of the CRLF stream (so a CR ends one chunk
    and its LF starts the next; '\u00e9' is split between its two UTF-8 bytes)."""
    raw = STREAM.replace("\n", "\r\n").encode()
    for cut in range(len(raw) + 1):
        assert _parse([raw[:cut], raw[cut:]]) == EXPECTED, cut
    assert _parse([raw[i : i + 1] for i in range(len(raw))]) == EXPECTED


def test_a_lone_cr_then_a_new_line_is_two_line_ends() -> None:
    # "data: x\r" + "\rdata: y\n\n": CR CR is an empty line (dispatch) after the x line
    assert _parse([b"data: x\r", b"\rdata: y\n\n"]) == [SSEEvent("x"), SSEEvent("y")]


def test_bom_and_empty_chunks() -> None:
    assert _parse([b"\xef\xbb", b"", b"\xbfdata: a\n\n"]) == [SSEEvent("a")]


def test_aiter_sse_yields_each_event_when_its_chunk_arrives() -> None:
    async def chunks():
        yield b"data: 1\n\ndata: "
        yield b"2\n"
        yield b"\n"

    async def collect() -> list[str]:
        return [e.data async for e in aiter_sse(chunks())]

    assert asyncio.run(collect()) == ["1", "2"]
