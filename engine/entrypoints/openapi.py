"""The server's own contract: an OpenAPI 3.1 document built from the request models.

Request bodies are the pydantic models of `protocol.py` (the same ones that validate
requests), so the document cannot drift from what the server accepts. Every error is
declared with OpenAI's error shape. Served at `/openapi.json`; fuzzers (schemathesis)
read it to generate requests, valid and invalid.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
# Statuses any JSON route may answer with an error body (see docs/serving.md).
_ERROR_STATUSES = {
    "400": "invalid request (validation, unknown field, over a limit, a field this server does not implement)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body over server.max_body_bytes",
    "415": "body is not JSON",
    "429": "too many requests waiting (server.max_waiting_requests)",
    "503": "the engine process is not running",
}


class _Components:
    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {"Error": ERROR_SCHEMA}

    def ref(self, model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}


def _errors() -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {code: {"description": text, "content": body} for code, text in _ERROR_STATUSES.items()}


def _post(components: _Components, model: type[BaseModel], summary: str, streams: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": components.ref(model)}}},
            "responses": {"200": {"description": "OK", "content": ok}, **_errors()},
        }
    }


def _get(summary: str, media: str = "application/json", errors: bool = True) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": {media: {"schema": {}}}}}
    if errors:
        responses.update(_errors())
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route `api_server.build_app` registers."""
    c = _Components()
    paths = {
        "/v1/completions": _post(c, CompletionRequest, "Text completion (SSE with stream: true)", True),
        "/v1/chat/completions": _post(c, ChatCompletionRequest, "Chat completion (SSE with stream: true)", True),
        "/tokenize": _post(c, TokenizeRequest, "Token ids of a prompt or a chat", False),
        "/detokenize": _post(c, DetokenizeRequest, "Text of token ids", False),
        "/v1/models": _get("The served model"),
        "/health": _get("200 while the engine process runs, 503 otherwise", media="text/plain"),
        "/metrics": _get("Prometheus metrics", media="text/plain", errors=False),
        "/openapi.json": _get("This document", errors=False),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "servelab OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {
            "schemas": c.schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
