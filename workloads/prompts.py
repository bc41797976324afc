"""Prompts of an exact token length, built from real English text.

The corpus (`workloads/data/corpus.txt`, public-domain English prose) is tokenized once; a
prompt of n tokens is a window of n corpus tokens (cycling), decoded to text. Decoding then
re-encoding can change the count (BPE merges across the window edges), so `text()` fixes the
text up until `encode(text)` has exactly n tokens. Lengths count tokens without special
tokens (`add_special_tokens=False`): the server may add a BOS, and reports its own count.

Any tokenizer works that has `encode(text, add_special_tokens=...) -> list[int]` and
`decode(ids) -> str` (the engine's `engine.tokenizer.tokenizer.Tokenizer`, HF tokenizers).
"""

from __future__ import annotations

from importlib import resources
from typing import Protocol

import numpy as np

_MAX_FIX_ROUNDS = 12


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def default_corpus() -> str:
    """The built-in public-domain corpus text."""
    return resources.files("workloads").joinpath("data/corpus.txt").read_text(encoding="utf-8")


class PromptBuilder:
    """Builds token-id and text prompts of exact lengths from a corpus.

    Contract: `token_ids(n, offset)` returns n corpus token ids; `text(n, offset)` returns
    `(text, ids)` with `ids == encode(text, add_special_tokens=False)` and `len(ids) == n`,
    or raises ValueError when no such text was found (never silently a wrong length).
    """

    def __init__(self, tokenizer: TextTokenizer, corpus: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.corpus_ids = list(tokenizer.encode(corpus or default_corpus(), add_special_tokens=False))
        if len(self.corpus_ids) < 16:
            raise ValueError("corpus too small: needs at least 16 tokens")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def random_offset(self, rng: np.random.Generator) -> int:
        return int(rng.integers(0, len(self.corpus_ids)))

    def token_ids(self, n: int, offset: int = 0) -> list[int]:
        """n corpus token ids starting at `offset`, wrapping around the corpus."""
        size = len(self.corpus_ids)
        start = offset % size
        reps = (start + n) // size + 1
        return (self.corpus_ids * reps)[start : start + n]

    def text(self, n: int, offset: int = 0, head: str = "") -> tuple[str, list[int]]:
        """Text of exactly n tokens: `head` followed by corpus text (head counts toward n)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        for attempt in range(4):  # a different corpus window if one does not converge
            found = self._fit(n, offset + attempt * 97, head)
            if found is not None:
                return found
        raise ValueError(f"could not build a text prompt of exactly {n} tokens")

    def _fit(self, n: int, offset: int, head: str) -> tuple[str, list[int]] | None:
        head_len = len(self.encode(head)) if head else 0
        want = n - head_len  # corpus tokens to append; adjusted each round
        for _ in range(_MAX_FIX_ROUNDS):
            if want < 0:
                return None
            text = head + self.tokenizer.decode(self.token_ids(want, offset))
            ids = self.encode(text)
            if len(ids) == n:
                return text, ids
            want += n - len(ids)
        return None
