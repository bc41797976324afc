"""Structured output through a real server and the official openai client.

Acceptance: for each of 20 varied JSON schemas (tests/json_schemas.py), a chat completion
with `response_format={"type": "json_schema", ...}` returns text that parses and validates,
streaming and not; an invalid schema is a 400 JSON error; vLLM's guided_* extensions work
on both endpoints. All 40 acceptance requests are in flight at once, so they share steps.

Greedy streaming and non-streaming requests for one schema give the same text only where each
row's logits do not depend on the rows beside it: the two land in different steps whenever the
load shifts them (a run beside other tests did: "JSON-P" against "JSON-R"). So the server runs
with `model.batch_invariant` where this CPU has its kernels, and that check skips elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from json_schemas import SCHEMAS, validate
from server_utils import ServerProcess, start_server

from engine.kernels.batch_invariance import machine_lacks

pytestmark = [pytest.mark.server, pytest.mark.timeout(400)]

MODEL = "smollm2"
MAX_TOKENS = 120
LACKS = machine_lacks()  # what this machine lacks for model.batch_invariant's kernels (None: nothing)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    invariant = ["model.batch_invariant=true", "model.dtype=bfloat16"] if LACKS is None else []
    proc = start_server(tmp_path_factory.mktemp("so_server"), "model.max_model_len=512", *invariant)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def _ask(client: openai.OpenAI, name: str, schema: dict[str, Any], stream: bool) -> tuple[str, str | None]:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Reply with a JSON object describing a {name.replace('_', ' ')}."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI) -> list[tuple[tuple[str, dict[str, Any], bool], tuple[str, str | None]]]:
    """The 40 acceptance requests (each schema streaming and not), all in flight at once."""
    jobs = [(name, schema, stream) for name, schema in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _ask(client, *job), jobs))
    return list(zip(jobs, results, strict=True))


def test_twenty_json_schemas_streaming_and_not(answers) -> None:  # type: ignore[no-untyped-def]
    problems = []
    for (name, schema, stream), (text, finish) in answers:
        try:
            assert finish == "stop", f"finish_reason {finish}"
            validate(json.loads(text), schema)
        except (AssertionError, ValueError) as exc:
            problems.append(f"{name} stream={stream}: {exc}: {text!r}")
    assert not problems, "\n".join(problems)


def test_streaming_and_not_give_the_same_text(answers) -> None:  # type: ignore[no-untyped-def]
    """Greedy, the same grammar, batch-invariant kernels: the same text, wherever each landed."""
    if LACKS is not None:
        pytest.skip(f"model.batch_invariant needs {LACKS}: without it a row's greedy tokens depend on the rows "
                    "that share its steps")
    differ = [a[0][0] for a, b in zip(answers[::2], answers[1::2], strict=True) if a[1][0] != b[1][0]]
    assert not differ, differ


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}},
        {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "(unclosed"}}},
        {"type": "yaml"},
    ],
)
def test_invalid_schema_is_a_400_json_error(client: openai.OpenAI, response_format: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format=response_format,  # type: ignore[arg-type]
        )
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "response_format", body
    assert "\n" not in str(body.get("message"))


def test_guided_extensions_on_both_endpoints(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Is water wet? Answer:", max_tokens=10, temperature=0.0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL, prompt="The year was", max_tokens=10, temperature=0.0,
        extra_body={"guided_regex": r" [12][0-9]{3}"},
    )
    assert len(r.choices[0].text) == 5 and r.choices[0].text[1:].isdigit()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is it ok?"}], max_tokens=20, temperature=0.0,
        extra_body={"guided_json": schema},
    )
    validate(json.loads(c.choices[0].message.content or ""), schema)
    r = client.completions.create(
        model=MODEL, prompt="A JSON object:", max_tokens=60, temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut off by max_tokens: still the start of an object
        assert r.choices[0].text.startswith("{")
    g = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Greet me."}], max_tokens=10, temperature=0.0,
        extra_body={"guided_grammar": 'start: "hello" | "goodbye"'},
    )
    assert g.choices[0].message.content in ("hello", "goodbye")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert info.value.status_code == 400
