"""What a constrained request asks for: exactly one of json / regex / choice / grammar / json_object.

vLLM's names: `StructuredOutputsParams` in `SamplingParams.structured_outputs`; the HTTP
layer fills it from OpenAI's `response_format` or vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` extensions (`from_request_fields`).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any


@dataclass
class StructuredOutputsParams:
    """One constraint. `json` is a JSON schema (a dict or its text; kept as text so the
    params cross the ZMQ wire unchanged); `json_object` is "any JSON object"."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            self.json = _json.dumps(self.json)
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object (got {what})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")

    @property
    def field(self) -> str:
        """The request field an error about this constraint names (`response_format`, ...)."""
        return FIELDS[self.key[0]]

    @property
    def key(self) -> tuple[str, str]:
        """Cache key: (kind, spec text). Equal keys compile to the same grammar."""
        if self.json is not None:
            return ("json", self.json)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _json.dumps(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")


# The request field each kind of constraint comes from, as errors name it.
FIELDS = {"json": "response_format", "json_object": "response_format", "regex": "guided_regex",
          "choice": "guided_choice", "grammar": "guided_grammar"}  # fmt: skip


def is_grammar_failure(message: str) -> bool:
    """Whether an engine error message is a constrained request's own grammar failing (it does
    not compile, or its compile timed out): those name the field first ("<field>: why"), so the
    HTTP layer answers them as the client's error (400), not the engine's."""
    return message.partition(":")[0] in FIELDS.values()


COMPILES_BUSY = "grammar compiles busy"


def is_compile_busy(message: str) -> bool:
    """Whether an engine error message is a grammar refused because `max_compiles_in_flight`
    compiles are in flight (grammar_cache.GrammarCache.get): the HTTP layer answers it 429,
    the client may retry later."""
    return message.startswith(COMPILES_BUSY + ":")


def from_request_fields(
    response_format: dict[str, Any] | None = None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> StructuredOutputsParams | None:
    """The constraint an OpenAI-style request body asks for (None: unconstrained).

    ValueError (one line, naming the field) for a malformed `response_format` or two
    constraints at once."""
    guided = {
        "guided_json": guided_json,
        "guided_regex": guided_regex,
        "guided_choice": guided_choice,
        "guided_grammar": guided_grammar,
    }
    set_fields = [k for k, v in guided.items() if v is not None]
    from_format = _from_response_format(response_format)
    if from_format is not None:
        set_fields.append("response_format")
    if len(set_fields) > 1:
        raise ValueError(f"{set_fields[1]}: only one of {', '.join(set_fields)} may be given")
    if from_format is not None:
        return from_format
    if guided_json is not None:
        if isinstance(guided_json, str):
            try:
                guided_json = _json.loads(guided_json)
            except ValueError:
                raise ValueError("guided_json: not valid JSON") from None
        if not isinstance(guided_json, dict):
            raise ValueError("guided_json: must be a JSON schema object")
        return StructuredOutputsParams(json=guided_json)  # type: ignore[arg-type]
    if guided_regex is not None:
        return StructuredOutputsParams(regex=guided_regex)
    if guided_choice is not None:
        if not guided_choice:
            raise ValueError("guided_choice: must not be empty")
        return StructuredOutputsParams(choice=list(guided_choice))
    if guided_grammar is not None:
        return StructuredOutputsParams(grammar=guided_grammar)
    return None


def _from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format: json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name only: any object
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema.schema must be a JSON object")
        return StructuredOutputsParams(json=schema)  # type: ignore[arg-type]
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
