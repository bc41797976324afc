"""N-gram (prompt lookup) proposer, vLLM's `method: "ngram"`.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: the last n tokens are the
pattern; its most recent earlier occurrence in the request's own tokens (prompt and
outputs) is the match, and the up-to-k tokens that followed it are the drafts. No match:
no drafts (the request decodes one token as usual). Pure host work: numpy over the token
ids, O(len * n) per request per step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.config import SpeculativeConfig
from engine.request import Request, RequestStatus


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default num_speculative_tokens) draft tokens continuing `token_ids`."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        if k <= 0 or size < self.min_n + 1:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            pattern = tokens[size - n :]
            # windows starting at 0 .. size-1-n: each ends before the last token, so a
            # match always has at least one token after it.
            windows = sliding_window_view(tokens[: size - 1], n)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def propose_for(self, requests: list[Request], max_model_len: int, skip: set[str] | None = None) -> int:
        """Set `spec_token_ids` of every running request in decode position that may be
        speculated on (see `speculable`); returns the drafts proposed. Drafts never run past
        max_tokens (the last output token is never a draft) or the length limit."""
        total = 0
        for request in requests:
            request.spec_token_ids = []
            if request.status != RequestStatus.RUNNING or request.num_computed_tokens != request.num_tokens - 1:
                continue
            if skip and request.request_id in skip or not speculable(request):
                continue
            k = min(self.k, max_model_len - request.num_tokens)
            if request.max_tokens is not None:
                k = min(k, request.max_tokens - request.num_output_tokens - 1)
            if k <= 0:
                continue
            drafts = self.propose(request.all_token_ids, k)
            request.spec_token_ids = drafts
            total += len(drafts)
        return total


def speculable(request: Request) -> bool:
    """Requests whose sampling the verifier reproduces exactly: no penalties (they depend
    on the drafts before each position), no logprobs, no grammar."""
    p = request.sampling_params
    return (
        p.structured_outputs is None
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )
