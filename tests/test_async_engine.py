"""EngineCore.step_with_batch_queue over the real model runner (dummy weights, 1 layer).

The dummy model is seeded, so two engines built alike compute the same logits: async
scheduling must give the same tokens as the synchronous loop, step for step, under
chunked prefill, prefix-cache hits, preemption, stop tokens and penalties. The
HF-transformers oracle (tests/test_oracle.py, slow) checks the real model.
"""

from __future__ import annotations

import pytest

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams


def _llm(async_scheduling: bool, **kw: object) -> LLM:
    args: dict[str, object] = dict(load_format="dummy", num_layers_override=1, max_num_seqs=8, num_blocks=64)
    args.update(kw)
    return LLM(model="smollm2", async_scheduling=async_scheduling, **args)


def _prompts(n: int, shared: int = 0) -> list[list[int]]:
    prefix = list(range(1000, 1000 + shared))
    return [prefix + list(range(100 + 37 * i, 100 + 37 * i + 9 + 5 * i)) for i in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine_core.scheduler.assert_idle()
    return [o.outputs[0].token_ids for o in outs]


def _both(prompts, params, **kw):  # noqa: ANN001, ANN202
    results = []
    for flag in (False, True):
        llm = _llm(flag, **kw)
        try:
            results.append(_tokens(llm, prompts, params))
            if flag:
                depths = [s.batch_queue_depth for s in llm.step_stats]
                assert 2 in depths, depths
        finally:
            llm.engine_core.shutdown()
    return results


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    ("case", "kw"),
    [
        ("plain", {}),
        ("chunked", {"max_num_batched_tokens": 16}),
        ("preemption", {"num_blocks": 6}),
        ("no_prefix_cache", {"enable_prefix_caching": False}),
    ],
)
def test_async_matches_sync(case: str, kw: dict) -> None:
    sync, async_ = _both(_prompts(6), GREEDY, **kw)
    assert async_ == sync
    assert all(len(t) == 12 for t in sync)


def test_async_matches_sync_with_prefix_hits() -> None:
    prompts = _prompts(5, shared=40)
    sync, async_ = _both(prompts + prompts[:2], GREEDY)
    assert async_ == sync


def test_async_stops_where_sync_stops() -> None:
    # Stop on a token the dummy model produces, at different points per request; the
    # token computed in the step scheduled before the stop is known never reaches the output.
    probe = _llm(False)
    try:
        free = _tokens(probe, _prompts(4), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    finally:
        probe.engine_core.shutdown()
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[t[2 + i % 3]])
        for i, t in enumerate(free)
    ]
    sync, async_ = _both(_prompts(4), params)
    assert async_ == sync
    assert all(len(t) < 10 or t[-1] == p.stop_token_ids[0] for t, p in zip(sync, params, strict=True))


def test_async_matches_sync_with_penalties_and_seeds() -> None:
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, seed=7 + i, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True)
        for i in range(4)
    ]
    sync, async_ = _both(_prompts(4), params)
    assert async_ == sync


def test_abort_with_steps_in_flight_leaves_nothing_behind() -> None:
    llm = _llm(True)
    core = llm.engine_core
    try:
        from engine.seam import EngineCoreRequest

        for i, p in enumerate(_prompts(3)):
            core.add_request(EngineCoreRequest(f"r{i}", p, GREEDY, None, 0.0, 12))
        core.step()  # fills the queue: step 0 in flight
        core.step()  # step 1 scheduled, step 0 answered
        assert core.batch_queue is not None and len(core.batch_queue) == 1
        core.abort_requests(["r1"])
        assert core.scheduler.kv_cache_manager.num_used_blocks > 0
        outputs = [o for _ in range(100) if core.has_unfinished_requests() for o in core.step().outputs]
        assert all(o.request_id != "r1" for o in outputs)
        assert not core.batch_queue
        core.scheduler.assert_idle()
        core.reconfigure()  # hands the last finished ids to the runner
        assert len(core.executor.model_runner.batch) == 0
    finally:
        core.shutdown()


def test_failed_step_drains_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm(True)
    core = llm.engine_core
    runner = core.executor.model_runner
    calls = {"n": 0}
    real = runner.run_step

    def failing(inp):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(inp)

    monkeypatch.setattr(runner, "run_step", failing)
    try:
        from engine.seam import EngineCoreRequest

        for i, p in enumerate(_prompts(2)):
            core.add_request(EngineCoreRequest(f"r{i}", p, GREEDY, None, 0.0, 12))
        with pytest.raises(RuntimeError, match="boom"):
            for _ in range(10):
                core.step()
        assert not core.batch_queue
        core.abort_requests(["r0", "r1"])  # what the core process / LLM do after a failure
        assert not core.has_unfinished_requests()
        core.scheduler.assert_idle()
    finally:
        core.shutdown()
