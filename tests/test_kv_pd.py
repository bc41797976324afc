"""Prefill/decode disaggregation: a prefill server (kv_producer) and a decode server
(kv_consumer) joined by Mooncake's store, behind `servelab-router`, against one server alone.

Real SmolLM2 weights; every server is a real process. The single-instance reference is the
prefill server asked directly for the whole answer (a full engine: the router is the only
difference). Needs Mooncake as tests/test_kv_mooncake.py does.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from server_utils import PYTHON, ServerProcess, free_port
from test_kv_mooncake import _mooncake_missing
from test_oracle import PROMPTS, SYSTEM

from engine.kv_transfer.mooncake_master import MooncakeMaster
from workloads.targets.pd import parse_connector_counters

pytestmark = pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))

MAX_TOKENS = 8
# Five of the HF oracle's prompts (tests/test_oracle.py): short ones (no full block: decode computes
# all), the two with the long system prefix (blocks come from the store), and the Chinese one.
PD_PROMPTS = [PROMPTS[i] for i in (0, 1, 6, 7, 8)]


def _launch(tmp: Path, name: str, cmd: list[str]) -> ServerProcess:
    port = free_port()
    log = tmp / f"{name}.log"
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return ServerProcess(proc, port, log)


def _wait_ready(server: ServerProcess, path: str = "/v1/models", timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.base_url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"server not ready in {timeout_s:.0f} s:\n{server.log()}")


def _engine_server(tmp: Path, name: str, master: MooncakeMaster, role: str) -> ServerProcess:
    config = {
        "model": {"model": "smollm2"},
        "cache": {"block_size": 16, "num_blocks": 128},
        "scheduler": {"max_num_seqs": 8},
        "kv_transfer": {"kv_connector": "MooncakeStoreConnector", "kv_role": role,
                        "kv_connector_extra_config": master.extra_config(global_segment_size=64 << 20,
                                                                         local_buffer_size=32 << 20)},
    }  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return _launch(tmp, name, [PYTHON, "-m", "engine.entrypoints.serve", "--config", str(path)])


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("pd")
    with MooncakeMaster(log_path=tmp / "master.log") as master:
        servers = {"prefill": _engine_server(tmp, "prefill", master, "kv_producer"),
                   "decode": _engine_server(tmp, "decode", master, "kv_consumer")}  # fmt: skip
        try:
            for s in servers.values():
                _wait_ready(s)
            p, d = servers["prefill"].base_url, servers["decode"].base_url
            router = [PYTHON, "-m", "engine.entrypoints.router", "--prefill", p, "--decode", d]
            servers["router"] = _launch(tmp, "router", router)
            # A second router whose decode pool also holds the prefill server (a full engine).
            servers["router2"] = _launch(tmp, "router2", [*router, "--decode", p, "--policy", "least_loaded"])
            _wait_ready(servers["router"], "/health", 30)
            _wait_ready(servers["router2"], "/health", 30)
            yield servers
        finally:
            for s in servers.values():
                s.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, prompt: str, chat: bool, stream: bool) -> tuple[str, int]:
    """(text, cached prompt tokens or -1 when a stream does not say)."""
    args = dict(model="smollm2", max_tokens=MAX_TOKENS, temperature=0.0)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = client.chat.completions.create(messages=messages, stream=True, **args)  # type: ignore[call-overload]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), -1
        r = client.chat.completions.create(messages=messages, **args)  # type: ignore[call-overload]
        return r.choices[0].message.content or "", _cached(r)
    if stream:
        chunks = client.completions.create(prompt=prompt, stream=True, **args)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in chunks if c.choices), -1
    r = client.completions.create(prompt=prompt, **args)  # type: ignore[call-overload]
    return r.choices[0].text, _cached(r)


def _cached(r: object) -> int:
    details = getattr(getattr(r, "usage", None), "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", 0) or 0)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_router_outputs_equal_a_single_instance(pd: dict[str, ServerProcess], chat: bool) -> None:
    router, single = _client(pd["router"]), _client(pd["prefill"])
    loaded = 0
    for prompt in PD_PROMPTS:
        got, cached = _complete(router, prompt, chat, stream=False)
        got_stream, _ = _complete(router, prompt, chat, stream=True)
        want, _ = _complete(single, prompt, chat, stream=False)
        assert (got, got_stream) == (want, want), prompt
        loaded += cached
    # The decode server had never seen these prompts: its cached tokens came from the store.
    assert loaded >= 16 * sum(p.startswith(SYSTEM) for p in PD_PROMPTS), loaded
    counters = {role: parse_connector_counters(urllib.request.urlopen(pd[role].base_url + "/metrics").read().decode())
                for role in ("prefill", "decode")}  # fmt: skip
    assert counters["prefill"]["saved_blocks"] > 0 and counters["prefill"]["loaded_blocks"] == 0, counters
    assert counters["decode"]["loaded_blocks"] > 0 and counters["decode"]["saved_blocks"] == 0, counters


def test_killed_decode_instance_gives_json_errors_and_the_others_keep_serving(pd: dict[str, ServerProcess]) -> None:
    decode = pd["decode"]
    decode.proc.send_signal(signal.SIGKILL)
    decode.proc.wait(10)
    for status in (502, 503):  # unreachable, then left out of the pool
        req = urllib.request.Request(pd["router"].base_url + "/v1/completions", method="POST",
                                     data=json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(info.value.read())
        assert info.value.code == status and body["error"]["code"] == status, body
    # router2 also has the prefill server as a decode instance: after one 502 it serves through it.
    client = _client(pd["router2"])
    outcomes = []
    for _ in range(4):
        try:
            outcomes.append(_complete(client, "The quick brown fox", chat=False, stream=False)[0] != "")
        except openai.APIStatusError as exc:
            outcomes.append(exc.status_code)
    assert outcomes.count(True) >= 3 and set(outcomes) <= {True, 502}, outcomes
