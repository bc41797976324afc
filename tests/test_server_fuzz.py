"""The API fuzzed from its own contract (issue 13, item 3).

`servelab-serve` publishes `/openapi.json`, built from the same pydantic models that
validate requests. schemathesis generates requests from it, valid ones and invalid
ones, against a live server (the default model cut to 2 layers so generation is cheap):
no answer is a 5xx, every error is a JSON body in OpenAI's error shape, and the server
still answers a good request afterwards. CI runs a bounded number of cases per
operation (FUZZ_CASES, default 25); `make soak` runs thousands.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_utils import ServerProcess, start_server  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]
CASES = int(os.environ.get("FUZZ_CASES", "25"))
# Valid requests really generate: keep each one small (the contract allows far more).
MAX_TOKENS, MAX_N = 4, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("fuzz"),
        "model.num_layers_override=2",
        "model.max_model_len=96",
        "server.max_body_bytes=65536",
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - loopback only
        return resp.status, resp.read()


def _bounded(body: object) -> object:
    if isinstance(body, dict):
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > MAX_TOKENS:
            body["max_tokens"] = MAX_TOKENS
        if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > MAX_TOKENS:
            body["max_completion_tokens"] = MAX_TOKENS
        if isinstance(body.get("n"), int) and body["n"] > MAX_N:
            body["n"] = MAX_N
        body.setdefault("max_tokens", MAX_TOKENS)
    return body


def _check_error_shape(status: int, content: bytes, what: str) -> None:
    obj = json.loads(content)
    err = obj.get("error") if isinstance(obj, dict) else None
    assert isinstance(err, dict), f"{what}: {status} without an OpenAI error body: {content[:200]!r}"
    assert isinstance(err.get("message"), str) and err["message"], what
    assert isinstance(err.get("type"), str), what
    assert "Traceback" not in err["message"], what


def _fuzz(operation, modes, base_url: str, statuses: Counter[int]) -> None:  # noqa: ANN001
    strategy = st.one_of([operation.as_strategy(generation_mode=m) for m in modes])

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case: schemathesis.Case) -> None:
        case.body = _bounded(case.body)
        response = case.call(base_url=base_url, timeout=120)
        what = f"{operation.method.upper()} {operation.path} body={str(case.body)[:300]}"
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{what}: {response.status_code} {response.content[:300]!r}"
        if response.status_code >= 400:
            _check_error_shape(response.status_code, response.content, what)

    fuzz()


def test_openapi_document_describes_every_route(server: ServerProcess) -> None:
    status, raw = _get(server.base_url + "/openapi.json")
    doc = json.loads(raw)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize", "/detokenize"} <= set(
        doc["paths"]
    )
    assert "CompletionRequest" in doc["components"]["schemas"]


def test_api_fuzzed_from_its_contract(server: ServerProcess, tmp_path: Path) -> None:
    _, raw = _get(server.base_url + "/openapi.json")
    schema = schemathesis.openapi.from_dict(json.loads(raw))
    statuses: Counter[int] = Counter()
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path not in ("/metrics", "/openapi.json", "/health")]
    assert operations
    for operation in operations:
        _fuzz(operation, modes, server.base_url, statuses)
    assert statuses, "nothing was sent"
    (tmp_path / "statuses.json").write_text(json.dumps(statuses))
    print("fuzz statuses:", dict(sorted(statuses.items())))
    # The server still answers a good request.
    req = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback only
        body = json.loads(resp.read())
    assert resp.status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses), dict(statuses)
