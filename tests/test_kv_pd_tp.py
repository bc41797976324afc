"""Prefill/decode disaggregation with tensor parallelism on both sides (issue 60 item 8).

A producer engine and a consumer engine, each TP=2 over two gloo worker processes on 127.0.0.1,
joined by Mooncake: its store (MooncakeStoreConnector) or reads straight from the producer's
outbox (MooncakeTransferConnector). SmolLM2's 3 KV heads split 2 + 1 over the ranks, so each rank
moves a slice of a different size under its own key or from its own outbox; the consumer must
load every full block of the prompt from the producer (no recompute) and then generate the
producer's tokens with the producer's log-probabilities (a rank that loaded another rank's
slice, or none, would not). Random weights of two layers keep four ranks' start-up short; the
KV bytes differ per head all the same. Needs Mooncake as tests/test_kv_mooncake.py does.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from test_kv_mooncake import _mooncake_missing

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.kv_transfer.metadata import KVConnectorOutput
from engine.kv_transfer.mooncake_master import MooncakeMaster
from engine.kv_transfer.tp_output import TPOutputMerger
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreRequest

needs_mooncake = pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))

BLOCK = 16
PROMPT = [(i * 104729) % 40000 + 100 for i in range(BLOCK * 4 + 9)]  # 4 full blocks and a tail
MAX_TOKENS = 6


def _two_free_ports() -> int:
    """A port P with P + 1 free too (rank 1's directory)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _config(connector: str, role: str, master: MooncakeMaster, directory: str) -> EngineConfig:
    if connector == "MooncakeStoreConnector":
        extra = master.extra_config(global_segment_size=16 << 20, local_buffer_size=16 << 20, retry_after_s=60)
    else:
        extra = {"metadata_server": master.metadata_server, "lookup_timeout_s": 2.0, "retry_after_s": 60}
        extra |= {"directory_address": directory, "outbox_blocks": 16} if role == "kv_producer" else \
            {"producer_directories": [directory], "read_buffer_bytes": 1 << 20}
    return EngineConfig.from_kwargs(
        model="smollm2", load_format="dummy", num_layers_override=2, dtype="float32", tensor_parallel_size=2,
        block_size=BLOCK, num_blocks=32, max_num_seqs=2, max_model_len=256,
        kv_transfer_config={"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra},
    )  # fmt: skip


def _run(core: EngineCore, rid: str) -> tuple[list[int], list[list[tuple[int, float]]], int]:
    """(tokens, each token's top-5 log-probabilities, cached prompt tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    core.add_request(EngineCoreRequest(rid, PROMPT, sp, None, 0.0, MAX_TOKENS))
    tokens: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    cached = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
            tops += [top for _, _, top in out.new_logprobs or []]
            cached = max(cached, out.num_cached_tokens)
    core.scheduler.assert_idle()
    return tokens, tops, cached


def _block_hashes(core: EngineCore) -> list[bytes]:
    probe = Request("probe", PROMPT, SamplingParams(max_tokens=1), None)
    probe.set_block_hasher(core.scheduler._block_hasher)  # type: ignore[arg-type]
    return list(probe.block_hashes)


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


@needs_mooncake
@pytest.mark.parametrize("connector", ["MooncakeStoreConnector", "MooncakeTransferConnector"])
def test_tp2_consumer_loads_each_ranks_slice_from_a_tp2_producer(master: MooncakeMaster, connector: str) -> None:
    directory = f"tcp://127.0.0.1:{_two_free_ports()}"
    producer = EngineCore(_config(connector, "kv_producer", master, directory))
    consumer = None
    try:
        assert producer.executor.world_size == 2  # type: ignore[attr-defined]
        want, want_tops, _ = _run(producer, "p")
        if connector == "MooncakeStoreConnector":  # every rank's objects are in the store, under its own keys
            from engine.kv_transfer.keys import rank_key_prefixes

            store = producer.kv_connector.store  # type: ignore[union-attr]
            keys = [prefix + h.hex() for prefix in rank_key_prefixes(producer.config) for h in _block_hashes(producer)]
            assert "-tp2r0-kvh0+2-" in keys[0] and "-tp2r1-kvh2+1-" in keys[-1]
            assert store.batch_is_exist(keys) == [1] * len(keys)
        consumer = EngineCore(_config(connector, "kv_consumer", master, directory))
        got, got_tops, cached = _run(consumer, "c")
        remote = consumer.scheduler.remote_kv
        assert remote is not None
        assert (remote.total_external_hit_tokens, cached, remote.total_load_failures) == (4 * BLOCK, 4 * BLOCK, 0)
        assert got == want
        for mine, theirs in zip(got_tops, want_tops, strict=True):
            assert [t for t, _ in mine] == [t for t, _ in theirs]
            assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in theirs], abs=1e-4)
    finally:
        if consumer is not None:
            consumer.shutdown()
        producer.shutdown()


def test_a_load_is_finished_when_every_rank_finished_it_and_failed_when_any_failed() -> None:
    merger = TPOutputMerger(2)
    step1 = merger.merge([KVConnectorOutput(finished_recving={"a", "b"}, failed_recving={"b"}, num_blocks_loaded=3,
                                            bytes_loaded={"a": 200}),
                          KVConnectorOutput(finished_recving={"c"}, bytes_loaded={"c": 50})])  # fmt: skip
    assert (step1.finished_recving, step1.failed_recving) == (set(), set())  # rank 1 has not finished a or b
    assert step1.num_blocks_loaded == 3 and step1.bytes_loaded == {"a": 200, "c": 50}
    step2 = merger.merge([KVConnectorOutput(finished_recving={"c"}),
                          KVConnectorOutput(finished_recving={"a", "b"}, bytes_loaded={"a": 100})])  # fmt: skip
    assert step2.finished_recving == {"a", "b", "c"} and step2.failed_recving == {"b"}
    assert step2.bytes_loaded == {"a": 100}
    assert merger.merge([KVConnectorOutput(), KVConnectorOutput()]).finished_recving == set()
