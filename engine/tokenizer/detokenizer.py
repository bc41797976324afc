"""Incremental detokenization with stop strings, for streaming.

Decoding is incremental (the prefix/read offset technique): each new token decodes
only a small window `ids[prefix_offset:]` and compares it with `ids[prefix_offset:
read_offset]`; the difference is the new text. A window that ends in U+FFFD is an
incomplete UTF-8 character (byte-level tokens split characters), so nothing is
emitted until the bytes that complete it arrive. The window starts with a few prompt
tokens so the first output token decodes in context.

Stop strings: the text is searched after every token (only the tail that can hold a
new match). On a match the text is cut before the stop string (after it with
`include_stop_str_in_output`) and `update` returns the string. Until the request
finishes, a tail of the text that could still be the start of a stop string is held
back from `output_text`, so a client never sees text that is later retracted.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class DecodingTokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | str | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop = [s for s in stops if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Decode window: prompt context, then every output token.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # all decoded output text (cut at a stop string)
        self._sent = 0  # characters of _text already returned as deltas
        self.finished = False
        self.stop_reason: str | None = None
        self.token_ids: list[int] = []

    # ---- feeding tokens ------------------------------------------------------------
    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string they completed (or None).

        After a stop string matched, further tokens are ignored.
        """
        for token_id in new_token_ids:
            if self.finished:
                break
            self.token_ids.append(token_id)
            self._ids.append(token_id)
            before = len(self._text)
            self._text += self._decode_next()
            if self.stop and len(self._text) > before:
                matched = self._check_stop(before)
                if matched is not None:
                    return matched
        return None

    def _decode_next(self) -> str:
        """New complete text from the window, advancing the offsets when there is some."""
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip)
        new_text = self.tokenizer.decode(self._ids[self._prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete character: wait for more bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _check_stop(self, before: int) -> str | None:
        """Search the text added since `before` (and the overlap a stop may span)."""
        start = max(0, before - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self._text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self._text = self._text[: idx + len(s)] if self.include_stop_str_in_output else self._text[:idx]
        self.finished = True
        self.stop_reason = s
        return s

    # ---- reading text --------------------------------------------------------------
    @property
    def output_text(self) -> str:
        """Text so far, minus a held-back tail that may still become a stop string."""
        if self.finished:
            return self._text
        return self._text[: len(self._text) - self._held_back()]

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream: since the last call (`delta`) or all of it.

        `finished=True` flushes everything that is not part of a stop string: a
        held-back tail and any incomplete character at the end (as U+FFFD).
        """
        if finished and not self.finished:
            self._flush()
        text = self.output_text
        if not delta:
            return text
        out = text[self._sent :]
        self._sent = len(text)
        return out

    def _flush(self) -> None:
        pending = self._ids[self._prefix_offset :]
        if len(pending) > self._read_offset - self._prefix_offset:
            prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset],
                                                self.skip_special_tokens)
            full = self.tokenizer.decode(pending, self.skip_special_tokens)
            self._text += full[len(prefix_text) :]
            self._read_offset = len(self._ids)
        self.finished = True
