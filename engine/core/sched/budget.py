"""The per-step token budget and sequence cap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBudget:
    """Tokens left to schedule this step and how many more requests may run.

    `long_prefill_token_threshold` (0: none) caps one request's share of a step
    (its prompt chunk); it never cuts a single decode token.
    """

    tokens_left: int
    long_prefill_token_threshold: int = 0

    def grant(self, wanted: int) -> int:
        """How many of `wanted` tokens one request may take now (not yet spent)."""
        n = min(wanted, self.tokens_left)
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return max(n, 0)

    def spend(self, n: int) -> None:
        assert 0 <= n <= self.tokens_left, (n, self.tokens_left)
        self.tokens_left -= n

    def refund(self, n: int) -> None:
        self.tokens_left += n

    @property
    def exhausted(self) -> bool:
        return self.tokens_left <= 0
