"""Mooncake's distributed store behind the connector: engines in two processes share prefixes,
and a dead master only costs recomputation.

Needs `mooncake-transfer-engine-non-cuda` (the `kv` extra) and Debian's libibverbs1 / libnuma1;
each test starts its own `mooncake_master` on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.kv_transfer.mooncake_master import MooncakeMaster, find_master_binary

HERE = Path(__file__).resolve().parent


def _mooncake_missing() -> str | None:
    if find_master_binary() is None:
        return "mooncake_master not installed (pip install 'servelab[kv]')"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # the native module needs libibverbs1 / libnuma1
        return f"mooncake.store does not load: {exc}"
    return None


pytestmark = pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with MooncakeMaster(log_path=tmp_path / "master.log") as m:
        yield m


def _engine(mode: str, m: MooncakeMaster, arg: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "mooncake_engine.py"), mode, m.master_server_address, m.metadata_server, arg],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw,  # type: ignore[call-overload]
    )  # fmt: skip


def test_second_engine_gets_every_full_block_from_the_store_and_the_same_tokens(master: MooncakeMaster) -> None:
    from mooncake_engine import greedy, kv_digest, make_core

    from engine.seam import EngineCoreRequest

    prompt = [(i * 104729) % 40000 + 100 for i in range(16 * 4 + 9)]  # 4 full blocks and a tail
    producer = _engine("produce", master, json.dumps([prompt]))
    try:
        consumer = make_core(master.master_server_address, master.metadata_server, "kv_consumer", real=True)
        line = producer.stdout.readline() if producer.stdout else ""
        assert line, f"the producer engine exited with {producer.poll()}"
        produced = json.loads(line)
        (cold,), (cold_kv,) = produced["tokens"], produced["kv_digests"]  # the producer ran cold
        consumer.add_request(EngineCoreRequest("c", prompt, greedy(6), None, 0.0, 6))
        got: list[int] = []
        cached = 0
        while consumer.has_unfinished_requests():
            for out in consumer.step().outputs:
                got += out.new_token_ids
                cached = max(cached, out.num_cached_tokens)
        remote = consumer.scheduler.remote_kv
        assert remote is not None
        assert (remote.total_external_hit_tokens, cached, remote.total_load_failures) == (4 * 16, 4 * 16, 0)
        assert got == cold
        assert kv_digest(consumer, prompt) == cold_kv, "the KV from the store differs from the producer's"
        consumer.scheduler.assert_idle()
        consumer.shutdown()
    finally:
        if producer.stdin:
            producer.stdin.close()
        producer.wait(timeout=30)


def test_master_killed_mid_run_requests_recompute_and_finish_without_leaks(master: MooncakeMaster) -> None:
    assert master.proc is not None
    proc = _engine("fault", master, str(master.proc.pid))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"fault run exited with {proc.returncode}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["planned_blocks"] == 3, result  # the hit's 3 full blocks were planned before the kill
    assert result["load_failures"] == 1, result
    assert sorted(result["finished"]) == ["hit", "long0", "long1"], result
    assert set(result["finished"].values()) == {"length"}, result
    assert result["idle"] is True, result
