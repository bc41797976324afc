"""20 varied JSON schemas for the structured-output acceptance test, and a validator.

Every schema is bounded (strings with maxLength, arrays with maxItems, closed objects,
numbers with a range) so that the small model's output completes well inside the test's
max_tokens: a grammar only forbids tokens, it does not shorten what the model wants to say,
and a reply cut off by max_tokens is unfinished JSON (vLLM behaves the same way).

`validate` uses the `jsonschema` package when installed (else `jsonschema_rs`), and always
runs its own check of the keywords used here, so the test never depends on either.
"""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **extra}


NAME = {"type": "string", "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
COLOR = {"enum": ["red", "green", "blue"]}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("person", _obj({"name": NAME, "age": AGE})),
    ("color", _obj({"color": COLOR})),
    ("flag", _obj({"ok": {"type": "boolean"}})),
    ("point", _obj({"x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": -50, "maximum": 50}})),
    ("price", _obj({"item": NAME, "price": {"type": "number", "minimum": 0, "maximum": 100}})),
    ("tags", _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}})),
    ("scores", _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                "maxItems": 3}})),
    ("nested", _obj({"user": _obj({"name": NAME, "admin": {"type": "boolean"}})})),
    ("deep", _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})})),
    ("status", _obj({"status": {"enum": ["open", "closed", "pending"]}, "priority": {"enum": [1, 2, 3]}})),
    ("city", _obj({"city": NAME, "country": {"enum": ["France", "Spain", "Italy"]}})),
    ("list_of_objects", _obj({"people": {"type": "array", "items": _obj({"name": NAME, "age": AGE}),
                                         "maxItems": 2}})),
    ("const", _obj({"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1, "maximum": 31}})),
    ("nullable", _obj({"note": {"type": ["string", "null"], "maxLength": 10}})),
    ("rgb", _obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                          "minItems": 3, "maxItems": 3}})),
    ("book", _obj({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                   "genre": {"enum": ["fiction", "science", "history"]}})),
    ("answer", _obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0,
                                                                        "maximum": 1}})),
    ("empty_allowed", _obj({"items": {"type": "array", "items": NAME, "maxItems": 2}})),
    ("matrix", _obj({"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})),
    ("order", _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "lines": {"type": "array", "maxItems": 2, "items": _obj({"sku": COLOR, "qty": AGE})},
                    "paid": {"type": "boolean"}})),
]


def validate(instance: Any, schema: dict[str, Any]) -> None:
    """AssertionError naming the path when `instance` does not satisfy `schema`."""
    try:
        import jsonschema

        jsonschema.validate(instance, schema)
    except ImportError:
        try:
            import jsonschema_rs

            jsonschema_rs.validate(schema, instance)
        except ImportError:
            pass
    _check(instance, schema, "$")


_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def _check(value: Any, schema: dict[str, Any], path: str) -> None:
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        assert any(_type_ok(value, k) for k in kinds), f"{path}: {value!r} is not of type {kinds}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != {schema['const']!r}"
    if isinstance(value, str) and "maxLength" in schema:
        assert len(value) <= schema["maxLength"], f"{path}: longer than {schema['maxLength']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value} out of range"
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{path}: item count"
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        if schema.get("additionalProperties") is False:
            extra = set(value) - set(props)
            assert not extra, f"{path}: unexpected keys {sorted(extra)}"
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{path}.{key}")
