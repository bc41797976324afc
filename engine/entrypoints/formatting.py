"""OpenAI response pieces: logprobs blocks, usage, ids. Pure functions of engine outputs."""

from __future__ import annotations

import time
import uuid
from functools import lru_cache
from typing import Any

from engine.seam import TokenLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenText:
    """Token id -> its text, memoized (logprob blocks name every token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=65536)(self._decode_one)
        self.tokenizer = tokenizer

    def _decode_one(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """Up to k top candidates, plus the sampled token when it is not among them."""
    sampled, lp, top = entry
    chosen = list(top[:k])
    if all(tid != sampled for tid, _ in chosen):
        chosen.append((sampled, lp))
    return chosen


def completion_logprobs(
    entries: list[TokenLogprobs], k: int, text: TokenText, text_offset: int
) -> dict[str, Any]:
    """The legacy completions `logprobs` object for these generated positions."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        tok = text(entry[0])
        tokens.append(tok)
        token_lps.append(_finite(entry[1]))
        tops.append({text(tid): _finite(lp) for tid, lp in _top(entry, k)} if k > 0 else None)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprobs], k: int, text: TokenText) -> dict[str, Any]:
    """The chat completions `logprobs` object: `{"content": [...]}`."""
    content = []
    for entry in entries:
        tok = text(entry[0])
        top = [
            {"token": text(tid), "logprob": _finite(lp), "bytes": list(text(tid).encode())}
            for tid, lp in (_top(entry, k)[:k] if k > 0 else [])
        ]
        content.append(
            {"token": tok, "logprob": _finite(entry[1]), "bytes": list(tok.encode()), "top_logprobs": top}
        )
    return {"content": content}


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clamps to a very negative number.
    return max(float(x), -9999.0)
