"""The KV connector boundary and the CPU offload tier, end to end through the engine.

Token-equality tests run the real SmolLM2 weights (a wrong block of KV changes the tokens);
the mechanics tests run one layer of dummy weights.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.kv_transfer.base import BlockStoreConnector, KVConnectorRole
from engine.kv_transfer.cpu_offload import CPUOffloadConnector
from engine.kv_transfer.metadata import BlockTransfer, KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreRequest
from engine.step_io import ModelRunnerOutput, SchedulerOutput

BS = 16
OFFLOAD = {"kv_connector": "CPUOffloadConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"num_cpu_blocks": 64}}  # fmt: skip


def make_core(real: bool = False, num_blocks: int = 8, kv: dict | None = OFFLOAD) -> EngineCore:
    args: dict[str, object] = dict(block_size=BS, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=256)
    # Real weights of the first 8 layers (the tokens and the KV bytes are compared), else 1 dummy layer.
    args.update(num_layers_override=8) if real else args.update(load_format="dummy", num_layers_override=1)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return EngineCore(EngineConfig.from_kwargs(model="smollm2", **args))


def run(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and its cached tokens (local + external)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, None, 0.0, max_tokens))
    tokens: list[int] = []
    cached = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


PREFIX = prompt(1, 4 * BS)
ASK = PREFIX + prompt(2, 9)  # 73 tokens: 4 full blocks of prefix, one more full block, a tail
FILLER = prompt(3, 8 * BS - 7)  # with its 6 outputs, every block of an 8-block cache


def test_cpu_tier_turns_an_evicted_prefix_into_a_hit_with_the_same_tokens() -> None:
    core = make_core(real=True, num_blocks=8)
    want, cached_first = run(core, "a", ASK)  # a cold run: nothing cached anywhere yet
    cold_kv = _prefix_kv(core)
    run(core, "filler", FILLER)  # evicts the prefix from the 8-block device cache
    assert core.scheduler.kv_cache_manager.get_computed_blocks(_request(ASK, core))[1] == 0, (
        "the filler should have evicted the prompt's blocks from the device cache"
    )
    again, cached_again = run(core, "b", ASK)
    remote = core.scheduler.remote_kv
    assert remote is not None
    assert (cached_first, remote.total_external_hit_tokens, cached_again) == (0, 4 * BS, 4 * BS)
    assert again == want
    assert torch.equal(_prefix_kv(core), cold_kv), "the KV loaded from the CPU tier differs from the computed KV"
    core.scheduler.assert_idle()
    core.shutdown()


def _prefix_kv(core: EngineCore) -> torch.Tensor:
    """The device KV of ASK's first 4 blocks (cached by the last run), [layers, 2, 4, bs, h, d]."""
    blocks, n = core.scheduler.kv_cache_manager.get_computed_blocks(_request(ASK, core))
    assert n >= 4 * BS
    ids = [b.block_id for b in blocks.blocks[:4]]
    return torch.stack([kv[:, ids] for kv in core.executor.worker.model_runner.kv_caches])  # type: ignore[attr-defined]


def _request(prompt_ids: list[int], core: EngineCore) -> Request:
    """A hashed request to probe the device cache with."""
    r = Request("probe", prompt_ids, SamplingParams(max_tokens=1), None)
    r.set_block_hasher(core.scheduler._block_hasher)  # type: ignore[arg-type]
    return r


def test_only_whole_blocks_before_the_last_token_load_and_the_tail_is_computed() -> None:
    core = make_core(num_blocks=16)
    exact = prompt(5, 3 * BS)  # 3 full blocks: the last one holds the last token, so 2 may load
    run(core, "a", exact)
    _drop_device_cache(core)
    _, cached = run(core, "b", exact)
    assert cached == 2 * BS
    core.scheduler.assert_idle()


def _drop_device_cache(core: EngineCore) -> None:
    assert core.scheduler.reset_prefix_cache(), "device cache busy"


def test_a_failed_load_recomputes_and_frees_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(num_blocks=16)
    want, _ = run(core, "a", ASK)
    _drop_device_cache(core)
    worker_half = core.executor.worker.kv_connector  # type: ignore[attr-defined]

    def broken(transfer: BlockTransfer):
        raise OSError("store went away")

    monkeypatch.setattr(worker_half, "get_blocks", broken)
    got, cached = run(core, "b", ASK)
    remote = core.scheduler.remote_kv
    assert remote is not None
    assert (got, cached, remote.total_load_failures, remote.total_external_hit_tokens) == (want, 0, 1, 0)
    core.scheduler.assert_idle()


def test_not_known_yet_parks_the_request_and_others_go_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(num_blocks=16)
    sched_half = core.kv_connector
    assert isinstance(sched_half, BlockStoreConnector)
    asked = {"slow": 0}

    def slow_lookup(hashes: list[bytes]) -> int | None:
        """The store answers "not known yet" twice for the 2-block lookup, then "none"."""
        if len(hashes) == 2 and asked["slow"] < 2:
            asked["slow"] += 1
            return None
        return 0

    monkeypatch.setattr(sched_half, "lookup", slow_lookup)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    core.add_request(EngineCoreRequest("slow", prompt(8, 3 * BS), params, None, 0.0, 2))
    core.add_request(EngineCoreRequest("fast", prompt(9, 5), params, None, 0.0, 2))
    core.step()
    sched = core.scheduler
    assert [r.request_id for r in sched.running] == ["fast"]
    assert sched.requests["slow"].status == RequestStatus.WAITING and sched.num_waiting == 1
    core.run_until_idle(max_steps=50)
    sched.assert_idle()


def test_abort_while_loading_frees_the_blocks_when_the_load_reports() -> None:
    core = make_core(num_blocks=16)
    run(core, "a", ASK)
    _drop_device_cache(core)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    core.add_request(EngineCoreRequest("b", ASK, params, None, 0.0, 2))
    sched = core.scheduler
    so = sched.schedule()  # b goes to WAITING_FOR_REMOTE_KVS with its blocks
    assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.kv_connector_metadata is not None and len(so.kv_connector_metadata.loads) == 1
    used = sched.kv_cache_manager.num_used_blocks
    sched.abort_requests(["b"])
    assert sched.kv_cache_manager.num_used_blocks == used, "freed under a load in flight"
    sched.update_from_output(so, core.executor.execute_model(so))
    core.run_until_idle(max_steps=5)
    sched.assert_idle()


def test_producer_saves_and_consumer_only_loads() -> None:
    producer = make_core(num_blocks=16, kv={**OFFLOAD, "kv_role": "kv_producer"})
    run(producer, "a", ASK)
    _drop_device_cache(producer)
    _, cached = run(producer, "b", ASK)
    assert cached == 0, "a producer never loads"
    consumer = make_core(num_blocks=16, kv={**OFFLOAD, "kv_role": "consumer"})
    run(consumer, "a", ASK)
    sched_half = consumer.kv_connector
    assert isinstance(sched_half, BlockStoreConnector) and not sched_half._index  # type: ignore[attr-defined]


def test_kv_transfer_config_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_role must be one of"):
        EngineConfig.from_kwargs(kv_transfer_config={"kv_connector": "CPUOffloadConnector", "kv_role": "leader"})
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        EngineConfig.from_kwargs(kv_transfer_config={"kv_connector": "Nope"})
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_kwargs(kv_transfer_config=OFFLOAD, async_scheduling=True)
    cfg = EngineConfig.from_sections({"kv_transfer": {"kv_connector": "CPUOffloadConnector", "kv_role": "both"}})
    assert cfg.kv_transfer.kv_role == "kv_both"


def test_blocks_of_a_request_with_saves_in_flight_are_freed_only_when_they_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = make_core(num_blocks=16)
    sched_half = core.kv_connector
    assert sched_half is not None
    monkeypatch.setattr(sched_half, "request_finished", lambda request: True)  # "my saves are asynchronous"
    run(core, "a", ASK, max_tokens=2)
    sched = core.scheduler
    assert sched.kv_cache_manager.num_used_blocks > 0 and not core.has_unfinished_requests()
    report = ModelRunnerOutput([], [], kv_connector_output=KVConnectorOutput(finished_sending={"a"}))
    sched.update_from_output(SchedulerOutput.empty(), report)
    sched.assert_idle()


def test_loads_under_memory_pressure_never_deadlock_and_leak_nothing() -> None:
    """Long prompts sharing prefixes in a cache that holds about one of them (the shape of
    `workload=shared_prefix` on 40 blocks): loads, preemptions and evictions interleave; every
    request finishes and every block comes back."""
    core = make_core(num_blocks=40, kv={**OFFLOAD, "kv_connector_extra_config": {"num_cpu_blocks": 128}})
    core.scheduler.config.max_num_batched_tokens = 2048
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prefixes = [prompt(20 + g, 16 * BS) for g in range(4)]
    for i in range(12):
        body = prefixes[i % 4] + prompt(40 + i, 50 + (37 * i) % 200)
        core.add_request(EngineCoreRequest(f"r{i}", body, params, None, 0.0, 4))
    done: set[str] = set()
    for _ in range(400):
        if not core.has_unfinished_requests():
            break
        done |= {o.request_id for o in core.step().outputs if o.finish_reason is not None}
    assert done == {f"r{i}" for i in range(12)}, f"unfinished: {core.scheduler.requests}"
    remote = core.scheduler.remote_kv
    assert remote is not None and remote.total_external_hit_tokens > 0
    core.scheduler.assert_idle()


# ---- asynchronous loads: the store's answer takes steps, the others keep stepping ------------


class GatedStore:
    """Wraps the worker half's `get_blocks`: each load blocks (on the load thread) until the test
    opens the gate, then returns the store's blocks, or raises when `fail`."""

    def __init__(self, core: EngineCore, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.worker_half = core.executor.worker.kv_connector  # type: ignore[attr-defined]
        self.real_get = self.worker_half.get_blocks
        self.fail = fail
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.on_loop_thread = False
        monkeypatch.setattr(self.worker_half, "get_blocks", self.get_blocks)

    def get_blocks(self, transfer: BlockTransfer) -> torch.Tensor:
        self.on_loop_thread |= threading.current_thread() is threading.main_thread()
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise OSError("store went away mid-load")
        return self.real_get(transfer)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def step_collect(core: EngineCore, tokens: dict[str, list[int]], cached: dict[str, int]) -> None:
    for out in core.step().outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)


@pytest.mark.parametrize("fail", [False, True], ids=["load", "failed-load"])
def test_a_slow_load_runs_off_the_loop_while_another_request_decodes(
    monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    core = make_core(real=True, num_blocks=16)
    want, _ = run(core, "a", ASK)  # cold: computes ASK and offloads its full blocks
    other = prompt(11, 15)  # no full block: never looks the store up
    want_other, _ = run(core, "o", other, max_tokens=12)
    _drop_device_cache(core)
    store = GatedStore(core, monkeypatch, fail=fail)
    sched = core.scheduler
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    core.add_request(EngineCoreRequest("decoder", other, greedy(12), None, 0.0, 12))
    step_collect(core, tokens, cached)  # its prefill and first token
    core.add_request(EngineCoreRequest("b", ASK, greedy(6), None, 0.0, 6))
    step_collect(core, tokens, cached)  # b starts its load; the decoder decodes
    assert store.entered.wait(10), "the load never started"
    for _ in range(5):  # the store holds the load: b waits, the decoder gets one token per step
        step_collect(core, tokens, cached)
    assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(tokens["decoder"]) == 7 and "b" not in tokens
    assert not store.on_loop_thread, "the load ran on the engine loop's thread"
    store.gate.set()
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        step_collect(core, tokens, cached)
    remote = sched.remote_kv
    assert remote is not None
    assert tokens["decoder"] == want_other
    assert tokens["b"] == want, "a loaded (or recomputed) prefix changed the tokens"
    if fail:
        assert (cached["b"], remote.total_load_failures, remote.total_external_hit_tokens) == (0, 1, 0)
    else:
        assert (cached["b"], remote.total_load_failures, remote.total_external_hit_tokens) == (4 * BS, 0, 4 * BS)
    sched.assert_idle()
    core.shutdown()


def test_abort_during_a_slow_load_holds_the_blocks_until_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(num_blocks=16)
    run(core, "a", ASK)
    _drop_device_cache(core)
    store = GatedStore(core, monkeypatch)
    sched = core.scheduler
    core.add_request(EngineCoreRequest("b", ASK, greedy(2), None, 0.0, 2))
    core.step()
    assert store.entered.wait(10) and sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    used = sched.kv_cache_manager.num_used_blocks
    core.abort_requests(["b"])
    for _ in range(3):
        core.step()
    assert sched.kv_cache_manager.num_used_blocks == used, "blocks freed under a load still writing them"
    assert core.has_unfinished_requests(), "the engine would stop polling the load"
    store.gate.set()
    core.run_until_idle(max_steps=500)
    sched.assert_idle()
    core.shutdown()


def test_cpu_tier_never_reassigns_a_slot_a_load_in_flight_reads() -> None:
    config = EngineConfig.from_kwargs(
        model="smollm2", load_format="dummy", block_size=BS,
        kv_transfer_config={**OFFLOAD, "kv_connector_extra_config": {"num_cpu_blocks": 2}},
    )  # fmt: skip
    tier = CPUOffloadConnector(config, KVConnectorRole.SCHEDULER, bytes_per_block=1)
    h1, h2, h3 = b"h1", b"h2", b"h3"
    saved = tier.select_saves(BlockTransfer("a", [0, 1], [h1, h2]))
    assert saved is not None and saved.slots == [0, 1]
    loader = SimpleNamespace(request_id="b", block_hashes=[h1, h2])
    tier.update_state_after_alloc(loader, [5, 6, 7], 0, 2 * BS)  # type: ignore[arg-type]
    assert tier.select_saves(BlockTransfer("c", [8], [h3])) is None, "a slot under a load was reassigned"
    assert list(tier._index) == [h1, h2]
    tier.update_connector_output(KVConnectorOutput(finished_recving={"b"}))
    again = tier.select_saves(BlockTransfer("c", [8], [h3]))
    assert again is not None and again.slots == [0] and list(tier._index) == [h2, h3]
