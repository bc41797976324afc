"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every error the server answers goes through `ApiError` so the body shape is uniform.
Messages are built from our own text or validation results, never from `repr()` of
objects or tracebacks (no memory addresses leak out).
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from aiohttp import web
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "server_error",
}
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
MAX_MESSAGE_CHARS = 1000


class ApiError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = clean_message(message)
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        err_type = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=headers)

    def sse(self) -> bytes:
        """The error as one SSE event (inside a stream, followed by `data: [DONE]`)."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def clean_message(message: str) -> str:
    """Strip anything that looks like a memory address and bound the length."""
    text = _ADDRESS.sub("0x…", message)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def from_value_error(exc: ValueError) -> ApiError:
    """A ValueError from input processing: its message starts with the field ("field: why")."""
    text = str(exc)
    head = text.split(":", 1)[0].split(" ", 1)[0]
    param = head if head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum() else None
    return ApiError(400, text, param=param)


def from_validation_error(exc: ValidationError) -> ApiError:
    """A pydantic ValidationError: name the first failing field and its problem."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        field, _, rest = msg.partition(": ")
        if rest and " " not in field:
            return ApiError(400, msg, param=field)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return ApiError(400, f"{loc or 'body'}: {msg}{more}", param=loc or None)


def _is_union_tag(part: object) -> bool:
    # pydantic puts the tried union member into `loc` (e.g. "list[int]"); not a field name.
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"})


def status_error(status: int, message: str | None = None) -> ApiError:
    return ApiError(status, message or HTTPStatus(status).phrase)
