"""A real `servelab-serve` process on the default model (SCENARIOS.md items 31-42).

One server for the module (max_model_len=96 so "what the context leaves" stays small,
an API key so auth is covered by the same process), once with the synchronous loop and
once with `scheduler.async_scheduling=true`. Talks to it with the official openai client
and with raw aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from server_utils import ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

API_KEY = "test-key"
MODEL = "smollm2"
MAX_LEN = 96
PROMPT = "The capital of France is"
LONG_PROMPT = "One two three four five six seven eight nine ten. " * 4  # > 2 KV blocks


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("server"),
        f"server.api_key={API_KEY}",
        f"model.max_model_len={MAX_LEN}",
        "server.max_body_bytes=65536",
        f"scheduler.async_scheduling={str(request.param).lower()}",
    )
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _greedy(**kw: object) -> dict[str, object]:
    return {"model": MODEL, "temperature": 0.0, "max_tokens": 6, **kw}


def _post(server: ServerProcess, path: str, body: object, headers: dict[str, str] | None = None,
          raw: bytes | None = None) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        h = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
        async with aiohttp.ClientSession() as s:
            data = raw if raw is not None else json.dumps(body).encode()
            async with s.post(server.base_url + path, data=data, headers=h) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


# ---- 31, 32, 39: completions --------------------------------------------------------------


def test_completion_usage_and_cached_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(**_greedy(prompt=LONG_PROMPT))
    assert r.id and len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    u = r.usage
    assert u.prompt_tokens + u.completion_tokens == u.total_tokens and u.completion_tokens == 6
    again = client.completions.create(**_greedy(prompt=LONG_PROMPT))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == r.choices[0].text


def test_priority_is_accepted_and_does_not_change_greedy_text(client: openai.OpenAI) -> None:
    plain = client.completions.create(**_greedy(prompt=PROMPT, max_tokens=3))
    ranked = client.completions.create(**_greedy(prompt=PROMPT, max_tokens=3), extra_body={"priority": 5})
    assert ranked.choices[0].text == plain.choices[0].text


def test_prompt_forms(server: ServerProcess, client: openai.OpenAI) -> None:
    ids = _post(server, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    one = client.completions.create(**_greedy(prompt=PROMPT, max_tokens=3))
    by_ids = client.completions.create(**_greedy(prompt=ids, max_tokens=3))
    assert by_ids.choices[0].text == one.choices[0].text
    batch = client.completions.create(**_greedy(prompt=[PROMPT, "Hello"], max_tokens=3))
    assert [c.index for c in batch.choices] == [0, 1]
    id_batch = client.completions.create(**_greedy(prompt=[ids, ids[:3]], max_tokens=3))
    assert [c.index for c in id_batch.choices] == [0, 1]
    assert id_batch.choices[0].text == one.choices[0].text


def test_max_tokens_unset_fills_the_context(server: ServerProcess, client: openai.OpenAI) -> None:
    ids = _post(server, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=None, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_LEN - len(ids) and r.choices[0].finish_reason == "length"


# ---- 33, 34: streaming ------------------------------------------------------------------


def test_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(**_greedy(prompt=PROMPT))
    chunks = list(client.completions.create(**_greedy(prompt=PROMPT), stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_chat_stream_role_first_and_matches(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_completion_tokens=8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                                 max_completion_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_stream_usage_options(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(**_greedy(prompt=PROMPT), stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens + 6 == last.usage.total_tokens
    cont = list(client.completions.create(**_greedy(prompt=PROMPT), stream=True,
                                          stream_options={"include_usage": True,
                                                          "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in cont)


# ---- 36, 37, 38: n, logprobs, echo ------------------------------------------------------------


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason for c in r.choices)
    assert len({c.text for c in r.choices}) > 1
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=4, stream=True))
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    none = client.completions.create(**_greedy(prompt=PROMPT))
    assert none.choices[0].logprobs is None
    r = client.completions.create(**_greedy(prompt=PROMPT, logprobs=3))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(**_greedy(prompt=PROMPT, echo=True, max_tokens=3))
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


# ---- 35, 37, 39, 40: the hostile battery ------------------------------------------------------


def _battery() -> list[tuple[int, str, object]]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (400, c, b"{not json"),
        (400, c, b"[1, 2]"),
        (400, c, b"\xff\xfe"),
        (400, c, {"prompt": "x", "bogus_field": 1}),
        (400, c, {"prompt": 5}),
        (400, c, {}),
        (400, c, {"prompt": "x", "max_tokens": "5"}),
        (400, c, {"prompt": "x", "max_tokens": True}),
        (400, c, {"prompt": "x", "max_tokens": 0}),
        (400, c, {"prompt": "x", "max_tokens": -3}),
        (400, c, {"prompt": "x", "temperature": -1}),
        (400, c, {"prompt": "x", "top_p": 0}),
        (400, c, {"prompt": "x", "top_k": -2}),
        (400, c, {"prompt": "x", "n": 0}),
        (400, c, {"prompt": "x", "presence_penalty": 3}),
        (400, c, {"prompt": "x", "seed": 1.5}),
        (400, c, {"prompt": "x", "stop": 3}),
        (400, c, {"prompt": "x", "logprobs": 21}),
        (400, c, {"prompt": "x", "stream_options": {"include_usage": True}}),
        (400, c, {"prompt": [1, -5, 3]}),
        (400, c, {"prompt": [10**9]}),
        (400, c, {"prompt": ""}),
        (400, c, {"prompt": []}),
        (400, c, {"prompt": "word " * 200}),
        (400, c, {"prompt": "x", "max_tokens": 10_000}),
        (404, c, {"prompt": "x", "model": "gpt-17"}),
        (400, c, {"prompt": "x", "suffix": "y"}),
        (400, c, {"prompt": "x", "logit_bias": {"5": 1.0}}),
        (400, ch, {"messages": []}),
        (400, ch, {"messages": [{"role": "wizard", "content": "hi"}]}),
        (400, ch, {"messages": [{"role": "user", "content": 5}]}),
        (400, ch, {"messages": msgs, "logprobs": True, "top_logprobs": 21}),
        (400, ch, {"messages": msgs, "stream_options": {"include_usage": True}}),
        (400, "/detokenize", {"tokens": [-1]}),
        (400, "/tokenize", {"prompt": "a", "messages": msgs}),
        (413, c, {"prompt": "x" * 100_000}),
    ]


def test_hostile_battery_then_good_request(server: ServerProcess, client: openai.OpenAI) -> None:
    battery = _battery()
    assert len(battery) >= 25
    for expected, path, body in battery:
        raw = body if isinstance(body, bytes) else None
        status, got = _post(server, path, body, raw=raw)
        assert status == expected, (path, body if raw is None else raw, got)
        err = got["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], got
        assert "Traceback" not in err["message"] and not re.search(r"0x[0-9a-f]{6,}", err["message"])
    status, got = _post(server, "/v1/completions", {"prompt": "word " * 200})
    assert str(MAX_LEN) in got["error"]["message"]  # names the lengths
    r = client.completions.create(**_greedy(prompt=PROMPT, max_tokens=2))
    assert r.choices[0].finish_reason == "length"


def test_method_and_route_errors(server: ServerProcess) -> None:
    async def go() -> list[int]:
        h = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession() as s:
            async with s.get(server.base_url + "/v1/completions", headers=h) as a:
                assert "error" in await a.json()
            async with s.get(server.base_url + "/v1/nothing", headers=h) as b:
                assert "error" in await b.json()
            return [a.status, b.status]

    assert asyncio.run(go()) == [405, 404]


# ---- 41, 42, auth, metrics --------------------------------------------------------------------


def test_auth(server: ServerProcess) -> None:
    async def go() -> list[int]:
        async with aiohttp.ClientSession() as s:
            codes = []
            for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}"}):
                async with s.get(server.base_url + "/v1/models", headers=h) as r:
                    codes.append(r.status)
            async with s.get(server.base_url + "/health") as r:
                codes.append(r.status)
            return codes

    assert asyncio.run(go()) == [401, 401, 200, 200]


def test_dropped_stream_frees_the_request(server: ServerProcess) -> None:
    async def go() -> str:
        h = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 80, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s, s.post(
            server.base_url + "/v1/completions", json=body, headers=h
        ) as r:
            await r.content.readline()  # the first chunk arrived: the request is running
        # leaving the block closed the connection mid-stream
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(server.base_url + "/metrics") as r:
                    text = await r.text()
                idle = _metric(text, "vllm:num_requests_running") == 0
                if idle and _metric(text, "vllm:kv_cache_usage_perc") == 0.0:
                    return text
                assert time.monotonic() - t0 < 1.0, "request still running 1 s after the drop"
                await asyncio.sleep(0.05)

    text = asyncio.run(go())
    for name in ("vllm:num_requests_waiting", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert name in text
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time",
                 "request_prefill_time", "request_decode_time"):
        assert f"vllm:{hist}_seconds_bucket" in text
