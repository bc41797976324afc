"""What a step-time model sees of one engine step: aggregates over the scheduled requests.

Every cost model here is a function of a few sums over the batch, so the simulated
executor accumulates them in one O(batch) pass of cheap Python and each model is O(1)
per step. Per request, `q` = tokens scheduled this step and `ctx` = tokens already in the
KV cache before the step (num_computed_tokens); query token j (1-based) attends to
ctx + j positions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class StepBatch:
    num_tokens: int = 0  # sum q
    num_reqs: int = 0
    num_sampled: int = 0  # requests that sample a token (LM head rows)
    num_prefill_tokens: int = 0  # tokens of requests not in decode
    num_decode_tokens: int = 0
    num_decode_reqs: int = 0
    attn_pairs: int = 0  # sum q*ctx + q*(q+1)/2: (query, key) pairs under the causal mask
    kv_tokens_read: int = 0  # sum ctx: cached K/V read by attention
    kv_blocks: int = 0  # sum ceil((ctx + q) / block_size): blocks the batch touches

    @property
    def num_prefill_reqs(self) -> int:
        """Scheduled requests not in decode (prompt chunks, recomputes)."""
        return self.num_reqs - self.num_decode_reqs

    @property
    def is_mixed(self) -> int:
        """1 when the step holds both prompt tokens and decodes (one forward over both), else 0."""
        return int(self.num_prefill_tokens > 0 and self.num_decode_reqs > 0)

    @property
    def prefill_tokens_sq(self) -> int:
        """num_prefill_tokens squared (a stand-in for causal attention within the prompt chunks)."""
        return self.num_prefill_tokens * self.num_prefill_tokens

    def add(self, q: int, ctx: int, samples: bool, is_decode: bool, block_size: int = 16) -> None:
        """Account one scheduled request (the executor's hot loop calls this inline)."""
        self.num_tokens += q
        self.num_reqs += 1
        self.num_sampled += samples
        if is_decode:
            self.num_decode_tokens += q
            self.num_decode_reqs += 1
        else:
            self.num_prefill_tokens += q
        self.attn_pairs += q * ctx + q * (q + 1) // 2
        self.kv_tokens_read += ctx
        self.kv_blocks += -(-(ctx + q) // block_size)

    @classmethod
    def from_requests(cls, reqs: Iterable[tuple[int, int, bool, bool]], block_size: int = 16) -> StepBatch:
        """From (q, ctx, samples, is_decode) per request."""
        batch = cls()
        for q, ctx, samples, is_decode in reqs:
            batch.add(q, ctx, samples, is_decode, block_size)
        return batch


class StepModel(Protocol):
    """Seconds one engine step takes on the modelled hardware.

    `step_time(batch)` must be cheap (called once per simulated step); `breakdown`
    returns the parts (seconds, summing to step_time) for reports. An empty batch costs 0.
    """

    def step_time(self, batch: StepBatch) -> float: ...

    def breakdown(self, batch: StepBatch) -> dict[str, float]: ...
