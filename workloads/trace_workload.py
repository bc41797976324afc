"""Turn trace rows into a workload (traces carry lengths and times, not prompt text).

Rows with `hash_ids` (Mooncake, or our JSONL) keep their prefix structure: block j of a prompt
is `block_size` token ids drawn from the corpus vocabulary by a generator seeded with the
block's hash id (and `salt`), so equal hash ids give equal tokens and different ids differ.
The prompt is the concatenation of its blocks cut to `prompt_tokens` (padded with corpus text
if the row has fewer blocks than its length needs). Rows without hash ids get corpus windows
at seeded random offsets; rows with `prompt` text send that text as is.

Token ids are exact; text prompts are decoded and fixed up at the tail to the exact length,
which can alter the last block's tokens: prefer `as_token_ids=True` for prefix-cache studies.
"""

from __future__ import annotations

import numpy as np

from workloads.prompts import PromptBuilder
from workloads.spec import RequestSpec
from workloads.traces import TraceRow

_TAIL_FIX = 8  # tokens left for the text fix-up at the end of a hash-id prompt


class BlockTokens:
    """Deterministic token ids per hash id: the same id always gives the same block."""

    def __init__(self, vocab: list[int], block_size: int, salt: int = 0) -> None:
        self.vocab = np.asarray(sorted(set(vocab)), dtype=np.int64)  # [V]
        self.block_size = block_size
        self.salt = salt
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        ids = self._cache.get(hash_id)
        if ids is None:
            rng = np.random.default_rng([self.salt, hash_id])
            ids = self.vocab[rng.integers(0, len(self.vocab), size=self.block_size)].tolist()
            self._cache[hash_id] = ids
        return ids

    def prompt(self, hash_ids: list[int], n: int, filler: list[int]) -> list[int]:
        """n ids: the blocks of `hash_ids` in order, then `filler`, cut to n."""
        out: list[int] = []
        for h in hash_ids:
            if len(out) >= n:
                break
            out.extend(self.block(h))
        if len(out) < n:
            out.extend(filler[: n - len(out)])
        return out[:n]


def trace_workload(
    rows: list[TraceRow],
    builder: PromptBuilder,
    rng: np.random.Generator,
    *,
    block_size: int = 512,
    as_token_ids: bool = True,
    salt: int = 0,
    id_prefix: str = "trace",
) -> list[RequestSpec]:
    """One spec per row, arriving at the row's timestamp (rows sorted by time)."""
    blocks = BlockTokens(builder.corpus_ids, block_size, salt)
    specs = []
    for i, r in enumerate(rows):
        prompt, ids = _row_prompt(r, builder, blocks, rng, as_token_ids)
        specs.append(
            RequestSpec(
                request_id=f"{id_prefix}-{i}",
                arrival_s=r.timestamp_s,
                prompt=prompt,
                prompt_token_ids=ids,
                prompt_len=r.prompt_tokens,
                max_tokens=max(1, r.output_tokens),
                group=r.group,
            )
        )
    return specs


def _row_prompt(
    r: TraceRow, builder: PromptBuilder, blocks: BlockTokens, rng: np.random.Generator, as_ids: bool
) -> tuple[str | None, list[int] | None]:
    if r.prompt is not None:
        return r.prompt, None
    n = r.prompt_tokens
    offset = builder.random_offset(rng)
    if not r.hash_ids:
        if as_ids:
            return None, builder.token_ids(n, offset)
        return builder.text(n, offset)[0], None
    filler = builder.token_ids(n, offset)
    ids = blocks.prompt(r.hash_ids, n, filler)
    if as_ids:
        return None, ids
    head = builder.tokenizer.decode(ids[: max(0, n - _TAIL_FIX)])
    return builder.text(n, offset, head=head)[0], None
