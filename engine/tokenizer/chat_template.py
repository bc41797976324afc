"""Rendering a model's Jinja chat template (the HF `apply_chat_template` conventions).

Templates come from model files, so they run in jinja2's immutable sandbox. They see
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, any extra keyword
arguments, and the helpers HF provides: `raise_exception(msg)` and `strftime_now(fmt)`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML: used only by tokenizers that ship no template (the byte-level fallback).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (via `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # HF's variant: no HTML escaping, unicode kept.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for `messages`; ChatTemplateError ("messages: ...") if rendering fails."""
    try:
        return compile_template(source).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **kwargs,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"messages: chat template error: {e}") from e
