"""MooncakeTransferConnector (engine/kv_transfer/mooncake_transfer.py): a consumer engine reads
the producer engine's KV blocks straight from its outbox with Mooncake's TransferEngine.

Two engines in this process (the first 8 layers of SmolLM2, real weights), mooncake_master for
the TransferEngine's metadata:
- the consumer serves a prompt the producer computed with an external hit of every full block,
  the same greedy tokens as the producer's cold run and the same KV bytes;
- the producer's outbox has room for fewer blocks than a second prompt fills: the blocks of the
  first prompt are overwritten, the consumer's header check fails the read, and it recomputes
  (same tokens, a load failure counted, no block leaked);
- the producer gone: lookups time out once, the consumer recomputes and finishes, assert_idle.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from test_kv_transfer_engine import _missing

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.kv_transfer.mooncake_master import MooncakeMaster
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreRequest

pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

BLOCK = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _core(role: str, master: MooncakeMaster, directory: str, outbox_blocks: int = 64) -> EngineCore:
    extra: dict[str, object] = {"metadata_server": master.metadata_server, "lookup_timeout_s": 0.5,
                                "retry_after_s": 60}  # fmt: skip
    if role == "kv_producer":
        extra |= {"directory_address": directory, "outbox_blocks": outbox_blocks}
    else:
        extra["producer_directories"] = [directory]
    return EngineCore(EngineConfig.from_kwargs(
        model="smollm2", num_layers_override=8, block_size=BLOCK, num_blocks=48, max_num_seqs=4,
        kv_transfer_config={"kv_connector": "MooncakeTransferConnector", "kv_role": role,
                            "kv_connector_extra_config": extra},
    ))  # fmt: skip


def _run(core: EngineCore, rid: str, prompt: list[int], n: int = 6) -> tuple[list[int], int]:
    core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                       None, 0.0, n))
    got, cached = [], 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            got += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    core.scheduler.assert_idle()
    return got, cached


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(i * 104729 + seed * 7919) % 40000 + 100 for i in range(BLOCK * blocks + 9)]


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


def test_consumer_reads_every_full_block_from_the_producer(master: MooncakeMaster) -> None:
    from mooncake_engine import kv_digest

    directory = f"tcp://127.0.0.1:{_port()}"
    producer = _core("kv_producer", master, directory, outbox_blocks=6)
    consumer = _core("kv_consumer", master, directory)
    try:
        first = _prompt(1, 4)  # 4 full blocks and a tail
        cold, _ = _run(producer, "p1", first)
        got, cached = _run(consumer, "c1", first)
        remote = consumer.scheduler.remote_kv
        assert remote is not None
        assert (remote.total_external_hit_tokens, cached, remote.total_load_failures) == (4 * BLOCK, 4 * BLOCK, 0)
        assert got == cold
        assert kv_digest(consumer, first) == kv_digest(producer, first), "the KV read differs from the producer's"
        consumer.reset_prefix_cache()

        # A 5-block prompt with an outbox of 6 slots: 3 of the first prompt's 4 slots (its
        # oldest) now hold the second prompt's blocks, so the producer no longer lists the first
        # prompt's first block: no external hit, computed here, the same tokens.
        second = _prompt(2, 5)
        cold2, _ = _run(producer, "p2", second)
        again, cached = _run(consumer, "c2", first)
        assert (again, cached, remote.total_external_hit_tokens) == (cold, 0, 4 * BLOCK)
        # the second prompt's 5 blocks are all there
        got2, cached2 = _run(consumer, "c3", second)
        assert (got2, cached2, remote.total_external_hit_tokens) == (cold2, 5 * BLOCK, 9 * BLOCK)
        assert remote.total_load_failures == 0
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_reused_slot_fails_the_read_and_the_tokens_are_recomputed(master: MooncakeMaster) -> None:
    """The producer overwrites a slot after the consumer's lookup and before its read: the
    header check catches it (a load failure), the consumer recomputes, same tokens."""
    directory = f"tcp://127.0.0.1:{_port()}"
    producer = _core("kv_producer", master, directory, outbox_blocks=4)
    consumer = _core("kv_consumer", master, directory)
    try:
        first = _prompt(3, 4)
        cold, _ = _run(producer, "p1", first)
        connector = consumer.scheduler.remote_kv.connector  # type: ignore[union-attr]
        real_lookup = connector.lookup

        def lookup_then_producer_moves_on(hashes: list[bytes]) -> int | None:
            n = real_lookup(hashes)
            _run(producer, "p2", _prompt(4, 4))  # refills all 4 slots with other blocks
            return n

        connector.lookup = lookup_then_producer_moves_on
        got, cached = _run(consumer, "c1", first)
        remote = consumer.scheduler.remote_kv
        assert remote is not None and remote.total_load_failures == 1
        assert got == cold
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_producer_gone_the_consumer_recomputes_without_hanging(master: MooncakeMaster) -> None:
    directory = f"tcp://127.0.0.1:{_port()}"  # nobody listens here
    consumer = _core("kv_consumer", master, directory)
    try:
        prompt = _prompt(5, 3)
        got, cached = _run(consumer, "c1", prompt)
        assert len(got) == 6 and cached == 0
        remote = consumer.scheduler.remote_kv
        assert remote is not None and remote.total_external_hit_tokens == 0
    finally:
        consumer.shutdown()
