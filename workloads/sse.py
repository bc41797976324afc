"""Server-sent events: one incremental parser for every SSE stream the workbench reads.

Follows the event-stream interpretation of the HTML standard (§9.2.6): lines end in CRLF, LF
or CR; a line starting with ":" is a comment; `field: value` (one leading space of the value
dropped), a line without ":" is a field with an empty value; `data` lines accumulate (joined
by "\\n"), `event` names the event, `id` sets the last event id (kept across events), `retry`
the reconnection time; unknown fields are ignored; a blank line dispatches the event (none if
no data was given). Input arrives as byte chunks cut anywhere — inside a line, inside a CRLF,
inside a UTF-8 character — so lines are split on bytes and decoded whole. What is left
without a closing blank line when the stream ends is dropped, as the standard says.

OpenAI-style streams put one JSON object per event in `data` and end with `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

DONE = "[DONE]"  # OpenAI's end-of-stream sentinel (an event whose data is this text)


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: its data lines joined by "\\n", its type ("message" unless an
    `event` field named another), the last event id seen so far and the last `retry` (ms)."""

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class SSEParser:
    """Feed byte chunks, get the events they complete (`feed`); one parser per stream."""

    def __init__(self) -> None:
        self._buf = bytearray()  # bytes after the last complete line
        self._skip_lf = False  # the last chunk ended in CR: an LF first in the next one is its pair
        self._first_line = True  # a UTF-8 BOM is dropped from the stream's first line only
        self._data: list[str] = []
        self._event = ""
        self._last_id = ""
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events completed by `chunk` (in order); a partial line waits for the next chunk."""
        if not chunk:
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buf = self._buf
        buf += chunk
        events: list[SSEEvent] = []
        start, n = 0, len(buf)
        # Next CR and LF at or after `start` (-1: none left); each is searched for again only
        # once passed, so a chunk of many lines is scanned once, not once per line.
        cr, lf = buf.find(b"\r"), buf.find(b"\n")
        while cr >= 0 or lf >= 0:
            end = lf if cr < 0 or (0 <= lf < cr) else cr
            step = 1
            if end == cr:  # a CRLF pair is one line end, even split across two chunks
                if end + 1 < n:
                    step = 2 if buf[end + 1] == 0x0A else 1
                else:
                    self._skip_lf = True
            event = self._line(bytes(buf[start:end]))
            if event is not None:
                events.append(event)
            start = end + step
            if cr >= 0 and cr < start:
                cr = buf.find(b"\r", start)
            if lf >= 0 and lf < start:
                lf = buf.find(b"\n", start)
        del buf[:start]
        return events

    def _line(self, raw: bytes) -> SSEEvent | None:
        if self._first_line:
            self._first_line = False
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        line = raw.decode("utf-8", errors="replace")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment (keep-alives are sent this way)
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None  # a blank line with no data before it dispatches nothing
        return SSEEvent("\n".join(data), event or "message", self._last_id, self._retry)


async def aiter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[SSEEvent]:
    """Events of a byte stream (e.g. aiohttp's `resp.content.iter_any()`), each yielded as soon
    as the chunk that completes it arrives."""
    parser = SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
