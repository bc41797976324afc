"""Input processing on the front end: chat template, tokenization, validation.

The one admission path: `InputProcessor.process` turns a prompt (or a chat) into a
`ProcessedRequest` (validated token ids, the resolved `max_tokens`), once; `fan_out`
turns that into the `EngineCoreRequest`s the core accepts, one per `n` child. `LLM`,
`AsyncLLM` and the HTTP layer all go through these two, so a prompt is tokenized
and checked exactly once whichever door it came in by.

Every rejection is a `ValueError` whose message starts with the offending field, so
the HTTP server can turn it into a 400 with `param` set and the offline API can show
it as is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreRequest


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A prompt tokenized and validated against the model, with its sampling parameters.

    `max_tokens` is resolved (never None, fits the context). `prompt` is the text it
    came from, when it came as text (shown on the outputs). Hand it to
    `AsyncLLM.generate` (or `fan_out`) as is: nothing checks it again.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_id: int | None
    arrival_time: float
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The core's ids for the `n` children of a request: the id itself when n == 1."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def fan_out(request_id: str, req: ProcessedRequest) -> list[EngineCoreRequest]:
    """One EngineCoreRequest per completion (`params.n` of them), child `i` seeded `seed + i`.

    The only place n > 1 is expanded: every child is an independent request in the
    core with `n=1`; the front end merges their outputs (`index` = i).
    """
    params = req.params
    ids = child_request_ids(request_id, params.n)
    children = []
    for i, rid in enumerate(ids):
        child_params = params if params.n == 1 else params.clone(
            n=1, seed=None if params.seed is None else params.seed + i
        )
        children.append(
            EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=req.prompt_token_ids,
                sampling_params=child_params,
                eos_token_id=req.eos_token_id,
                arrival_time=req.arrival_time,
                max_tokens=req.max_tokens,
                priority=req.priority,
                cache_salt=req.cache_salt,
            )
        )
    return children


class TokenizerLike(Protocol):
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


class InputProcessor:
    def __init__(self, tokenizer: TokenizerLike, max_model_len: int, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size or tokenizer.vocab_size

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}]: must be an object with a 'role'")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        # The template writes its own special tokens (BOS included where the model wants one).
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt: must be a non-empty string or list of token ids")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"prompt: token ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        left = self.max_model_len - num_prompt_tokens
        if left < 1:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens leave no room to generate in the model's "
                f"context of {self.max_model_len} tokens"
            )
        if params.max_tokens is None:
            return left
        if params.max_tokens > left:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens; "
                f"the request asks for {num_prompt_tokens + params.max_tokens} "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} to generate)"
            )
        return params.max_tokens

    def process(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, Any]] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_generation_prompt: bool = True,
    ) -> ProcessedRequest:
        """Tokenize (or render the chat) and validate; raises ValueError naming the field."""
        if messages is not None:
            prompt_ids = self.render_chat(messages, add_generation_prompt)
        elif prompt is None:
            raise ValueError("prompt: required")
        else:
            prompt_ids = self.tokenize_prompt(prompt)
        if params.structured_outputs is not None:
            from engine.structured_output.grammar import check

            check(params.structured_outputs)  # a bad schema / regex / grammar is a 400 here, not in the core
        return ProcessedRequest(
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=self.resolve_max_tokens(len(prompt_ids), params),
            eos_token_id=self.tokenizer.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt if isinstance(prompt, str) and messages is None else None,
            priority=priority,
            cache_salt=cache_salt,
        )
