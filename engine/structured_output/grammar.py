"""llguidance behind a small interface: grammar text from params, validation, matchers.

Why llguidance (measured on this 2-core CPU, vocab 49,152, see shared NOTES): compiling a
JSON schema takes ~1 ms (xgrammar ~5 ms) and a bitmask fill plus applying it to the logits
~48 µs per request per step (xgrammar ~163 µs, dominated by its mask application); its
tokenizer setup is slower (~0.3 s once, xgrammar ~0.1 s) but happens once per process.

JSON is generated compactly (no free whitespace): a small model given a free-whitespace
grammar can spend its whole budget on spaces and newlines.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import llguidance as llg

from engine.structured_output.params import StructuredOutputsParams

# llguidance's JSON compile options: separators without spaces, no optional whitespace.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_ANY_JSON_OBJECT = {"type": "object"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked). ValueError for a JSON schema
    that is not a JSON object."""
    kind, spec = params.key
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec, overrides=_JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        assert params.choice is not None
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in params.choice))
    return llg.LLMatcher.grammar_from_lark(spec)


def check(params: StructuredOutputsParams, tokenizer: llg.LLTokenizer | None = None) -> str:
    """The grammar text; ValueError "<field>: <why>" (one line) when it does not compile."""
    field = params.field
    try:
        text = grammar_text(params)
        error = llg.LLMatcher.validate_grammar(text, tokenizer)
    except Exception as exc:  # llguidance raises ValueError, or others for odd input: all are the request's fault
        raise ValueError(f"{field}: invalid {params.key[0]} ({_one_line(str(exc)) or type(exc).__name__})") from None
    if error and not error.startswith("WARNING"):
        raise ValueError(f"{field}: invalid {params.key[0]} ({_one_line(error)})")
    return text


class GrammarCompiler(Protocol):
    """The compile seam of `StructuredOutputManager`: the matcher template of `params` in its
    start state, or ValueError / RuntimeError (one line) when the grammar does not compile.
    Runs on a compile thread; it cannot be interrupted, so one that overruns
    `compile_timeout_s` is written off (engine/structured_output/grammar_cache.py). Tests
    inject slow ones here."""

    def __call__(self, tokenizer: llg.LLTokenizer, params: StructuredOutputsParams) -> llg.LLMatcher: ...


def compile_grammar(tokenizer: llg.LLTokenizer, params: StructuredOutputsParams) -> llg.LLMatcher:
    """llguidance's compile (`GrammarCompiler`): check against the vocabulary, then build."""
    return compile_matcher(tokenizer, check(params, tokenizer))


def make_tokenizer(tokenizer_json: str, eos_token_id: int | None) -> llg.LLTokenizer:
    """llguidance's view of the vocabulary, from a `tokenizers` JSON dump (~0.3 s: do it once)."""
    return llg.LLTokenizer(tokenizer_json, eos_token=eos_token_id)


def compile_matcher(tokenizer: llg.LLTokenizer, text: str) -> llg.LLMatcher:
    """A matcher in its start state; RuntimeError with the grammar's error if it fails.
    Drops the GIL while it compiles, so a compile thread does not stall the engine loop."""
    matcher = llg.LLMatcher(tokenizer, text, log_level=0)
    if matcher.is_error():
        raise RuntimeError(_one_line(matcher.get_error()))
    return matcher


def _lark_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string literal is a valid Lark string literal (escapes included)


def _one_line(msg: str) -> str:
    return " ".join(msg.split())[:300]
