"""The prompt forms `LLM.generate` accepts, as vLLM's offline API spells them.

    llm.generate("Hello")                                   # a string
    llm.generate(["Hello", "Bonjour"])                      # a list of strings
    llm.generate({"prompt": "Hello"})                       # TextPrompt
    llm.generate({"prompt_token_ids": [1, 2, 3]})           # TokensPrompt
    llm.generate([TextPrompt(prompt="Hi"), TokensPrompt(prompt_token_ids=[1, 2])])
    llm.generate([1, 2, 3]) / llm.generate([[1, 2], [3]])   # bare token ids (one / several)

Either dict form may carry `cache_salt` (isolates the request's prefix-cache
entries). Any other key (vLLM's `multi_modal_data`, ...) is refused with a
ValueError naming it, rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


SinglePrompt = str | list[int] | TextPrompt | TokensPrompt
PromptType = SinglePrompt | Sequence[SinglePrompt]

_TEXT_KEYS = frozenset({"prompt", "cache_salt"})
_TOKENS_KEYS = frozenset({"prompt_token_ids", "cache_salt"})


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """One prompt, unwrapped: text or token ids (checked later by the input processor)."""

    prompt: str | list[int]
    cache_salt: str | None = None


def parse_prompts(prompts: Any) -> list[ParsedPrompt]:
    """Flatten any accepted form into one `ParsedPrompt` per request, in order."""
    if isinstance(prompts, (str, Mapping)):
        return [_parse_one(prompts, "prompts")]
    if isinstance(prompts, list) and prompts and all(_is_token_id(t) for t in prompts):
        return [_parse_one(prompts, "prompts")]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(
            "prompts: must be a string, a {'prompt': ...} or {'prompt_token_ids': [...]} dict, "
            f"a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    return [_parse_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _parse_one(p: object, where: str) -> ParsedPrompt:
    if isinstance(p, str):
        return ParsedPrompt(p)
    if isinstance(p, list):
        return ParsedPrompt(p)  # token ids; the input processor checks each one
    if not isinstance(p, Mapping):
        raise ValueError(f"{where}: a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")
    if "prompt_token_ids" in p:
        keys, value = _TOKENS_KEYS, p["prompt_token_ids"]
        if not isinstance(value, list):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a list of token ids")
    elif "prompt" in p:
        keys, value = _TEXT_KEYS, p["prompt"]
        if not isinstance(value, str):
            raise ValueError(f"{where}: 'prompt' must be a string")
    else:
        raise ValueError(f"{where}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    unknown = sorted(set(p) - keys)
    if unknown:
        raise ValueError(f"{where}: unsupported key(s) {unknown}; this engine takes {sorted(keys)}")
    salt = p.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{where}: 'cache_salt' must be a string")
    return ParsedPrompt(value, salt)
