"""The aiohttp application: routes, auth, body limits, error mapping, metrics.

`build_app(llm, settings)` returns an `aiohttp.web.Application` serving the OpenAI
API on top of an AsyncLLM. Every error leaves as an OpenAI error body (errors.py);
an unexpected exception is a 500 whose message names only the exception type.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from engine.entrypoints.errors import ApiError, from_validation_error, from_value_error, status_error
from engine.entrypoints.formatting import now_s
from engine.entrypoints.openai_serving import OpenAIServing
from engine.entrypoints.openapi import openapi_document
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.frontend.async_llm import AsyncLLM
from engine.metrics.prometheus import CONTENT_TYPE, PrometheusMetrics

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)
STATE_KEY: web.AppKey[ServerState] = web.AppKey("state")
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


@dataclass
class ServerSettings:
    """The `server:` section of a servelab-serve config (conf/serve.yaml, or the `--config` file)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    max_logprobs: int = 20
    log_requests: bool = False
    multiprocess: bool = True
    ready_timeout_s: float = 600.0
    # Generation requests admitted but unfinished, at most (0: no bound); past it a new one
    # is answered 429 with Retry-After at once, so overload never grows an unbounded queue.
    max_pending_requests: int = 0
    # Output tokens per SSE content chunk, at least (1: a chunk per engine step). Larger values
    # imitate servers that coalesce tokens; the workbench tests per-token timing with it.
    stream_chunk_tokens: int = 1
    # A folder: trace the server process's memory with tracemalloc and write a sample every
    # 30 s there (memtrace.py; slows the server, for finding leaks only). None: off.
    tracemalloc_dir: str | None = None


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: ServerSettings
    model_name: str
    serving: OpenAIServing
    metrics: PrometheusMetrics


def build_app(llm: AsyncLLM, settings: ServerSettings, model_name: str) -> web.Application:
    """The app; the caller owns `llm` (start it before, shut it down after)."""
    metrics = PrometheusMetrics(model_name)
    llm.step_listeners.append(metrics.on_step)
    llm.finish_listeners.append(metrics.on_finished)
    state = ServerState(llm, settings, model_name, OpenAIServing(llm, model_name, settings.max_logprobs,
                                                             settings.stream_chunk_tokens), metrics)
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[_error_middleware, _auth_middleware(settings.api_key)],
    )
    app[STATE_KEY] = state
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app


# ---- middlewares ----------------------------------------------------------------------


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response({"Retry-After": "1"} if exc.status == 429 else None)
    except web.HTTPException as exc:  # 404 route, 405 method, 413 body...
        if exc.status < 400:
            raise
        return status_error(exc.status, _http_message(exc)).response(headers=_allow(exc))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, f"internal server error ({type(exc).__name__})").response()


def _http_message(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return f"request body too large: {exc.text or ''}".strip().rstrip(":")
    if exc.status == 404:
        return "not found"
    return exc.reason


def _allow(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None


def _auth_middleware(api_key: str | None) -> Any:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in PUBLIC_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    return auth


# ---- helpers --------------------------------------------------------------------------


def _state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


async def _parse(request: web.Request, model: type[M]) -> M:
    """Read and validate a JSON body; every failure is a 400 (or 413 for size)."""
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "body is not UTF-8"
        raise ApiError(400, f"invalid JSON body: {msg}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except ValueError as exc:
        raise from_value_error(exc) from None


def _require_engine(state: ServerState) -> None:
    if not state.llm.is_healthy():
        raise ApiError(500, "engine error: the engine process is not running", code="engine_dead")


# ---- handlers -------------------------------------------------------------------------


def _admit(state: ServerState) -> None:
    """429 when `server.max_pending_requests` generation requests are already unfinished."""
    limit = state.settings.max_pending_requests
    if limit > 0 and state.llm.num_in_flight >= limit:
        raise ApiError(
            429, f"server busy: {limit} requests in flight (server.max_pending_requests); retry later",
            code="too_many_requests",
        )


async def _completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await _parse(request, CompletionRequest)
    _require_engine(state)
    _admit(state)
    return await state.serving.completions(body, request)


async def _chat(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await _parse(request, ChatCompletionRequest)
    _require_engine(state)
    _admit(state)
    return await state.serving.chat(body, request)


async def _models(request: web.Request) -> web.Response:
    state = _state(request)
    card = {
        "id": state.model_name,
        "object": "model",
        "created": now_s(),
        "owned_by": "servelab",
        "max_model_len": state.llm.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    if _state(request).llm.is_healthy():
        return web.Response(status=200)
    raise ApiError(503, "the engine process is not running", code="engine_dead")


async def _tokenize(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _parse(request, TokenizeRequest)
    state.serving.check_model(body.model)
    ip = state.llm.input_processor
    try:
        if body.messages is not None:
            ids = ip.render_chat([m.as_dict() for m in body.messages], body.add_generation_prompt)
        else:
            assert body.prompt is not None
            ids = state.llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except ValueError as exc:
        raise from_value_error(exc) from None
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.llm.max_model_len})


async def _detokenize(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _parse(request, DetokenizeRequest)
    state.serving.check_model(body.model)
    vocab = state.llm.input_processor.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return web.json_response({"prompt": state.llm.tokenizer.decode(body.tokens)})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def _metrics(request: web.Request) -> web.Response:
    state = _state(request)
    if state.llm.is_healthy():
        with contextlib.suppress(Exception):  # a busy or dead core: keep the last step's values
            state.metrics.on_snapshot(await asyncio.wait_for(state.llm.get_stats(), 0.5))
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
