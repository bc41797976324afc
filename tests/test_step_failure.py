"""A step whose executor raises leaves nothing behind (issue 13, defect 1).

Before the fix the scheduler marked the step's requests in flight, the caller aborted
them, and the abort deferred their blocks to an `update_from_output` that never came
for the failed step: the KV cache leaked every block of every scheduled request.
"""

from __future__ import annotations

import pytest
from sched_utils import fake_runner_output, make_request, make_scheduler

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.model.arch import ModelArch
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreRequest
from engine.sim.executor import SimulatedExecutor
from engine.sim.step_batch import StepBatch

ARCH = ModelArch(8, 2, 4, 2, 2, 16, vocab_size=64, eos_token_id=8, max_position_embeddings=256)


class OneMsPerToken:
    def step_time(self, batch: StepBatch) -> float:
        return 1e-3 * batch.num_tokens

    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        return {"tokens": 1e-3 * batch.num_tokens}


class FailingExecutor(SimulatedExecutor):
    """Raises on the steps whose (0-based) execute count is in `fail_on`."""

    def __init__(self, config: EngineConfig, fail_on: set[int]) -> None:
        super().__init__(config, OneMsPerToken(), ARCH)  # type: ignore[arg-type]
        self.fail_on, self.calls = fail_on, 0

    def execute_model(self, scheduler_output):  # noqa: ANN001, ANN201
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail_on:
            raise RuntimeError("injected device fault")
        return super().execute_model(scheduler_output)


def _core(fail_on: set[int]) -> EngineCore:
    cfg = EngineConfig()
    cfg.cache.num_blocks = 32
    cfg.scheduler.max_num_batched_tokens = 24  # the 40-token prompt is chunked
    return EngineCore(cfg, FailingExecutor(cfg, fail_on))


def _add(core: EngineCore, rid: str, prompt_len: int, max_tokens: int = 4) -> None:
    core.add_request(
        EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=list(range(10, 10 + prompt_len)),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            eos_token_id=ARCH.eos_token_id,
            arrival_time=0.0,
            max_tokens=max_tokens,
        )
    )


@pytest.mark.parametrize("fail_on", [{0}, {1}, {2}, {3}])
def test_failed_step_frees_every_block_of_its_requests(fail_on: set[int]) -> None:
    core = _core(fail_on)
    _add(core, "a", 40)
    _add(core, "b", 5)
    raised = 0
    for _ in range(50):
        if not core.has_unfinished_requests():
            break
        try:
            core.step()
        except RuntimeError:
            raised += 1
            # What EngineCoreProc does: fail every request still in the engine.
            core.abort_requests(sorted(core.scheduler.requests))
    core.step()  # hands the finished ids to the runner
    assert raised >= 1
    core.scheduler.assert_idle()


def test_failed_step_finishes_its_requests_with_the_error() -> None:
    core = _core({1})
    _add(core, "a", 5, max_tokens=8)
    core.step()
    request = core.scheduler.requests["a"]
    with pytest.raises(RuntimeError):
        core.step()
    assert request.status.name == "FINISHED_ERROR" and "injected device fault" in (request.error or "")
    assert "a" not in core.scheduler.requests
    core.step()
    core.scheduler.assert_idle()


def test_every_step_has_its_own_index() -> None:
    """An empty step (only finished ids to hand over) must not share its index with the next
    step: steps.csv and kernels.csv join on it (issue 13, defect 7)."""
    cfg = EngineConfig()
    cfg.cache.num_blocks = 32
    core = EngineCore(cfg, FailingExecutor(cfg, set()))
    _add(core, "a", 5, max_tokens=2)
    indices = [core.step().stats.step for _ in range(3)]  # prefill, decode (finishes), empty hand-over
    _add(core, "b", 5, max_tokens=1)
    indices.append(core.step().stats.step)
    assert indices == sorted(set(indices)), indices
    core.scheduler.assert_idle()


# ---- issue 36, item 1: a failed step's prefix-cache entries --------------------------------
# Blocks are registered in the prefix cache when allocated (the step writes them before any
# later step reads them) and schedule() counts the step's tokens as computed before it runs.
# A step that never ran must take its registrations back, or a later prompt sharing the
# prefix hits blocks whose KV was never written.

P = list(range(300, 400))  # 100 tokens: 6 full blocks of 16 (96 tokens) and a tail


def test_a_failed_step_leaves_no_prefix_cache_entry_it_never_wrote() -> None:
    sched = make_scheduler(num_blocks=32, block_size=16)
    sched.add_request(make_request("a", prompt=P, max_tokens=4))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 100}
    errors = sched.fail_step(out, "injected device fault")
    assert [(o.request_id, o.error) for o in errors] == [("a", "injected device fault")]
    sched.add_request(make_request("b", prompt=P, max_tokens=4))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0, "a prefix hit on KV never written"
    sched.update_from_output(out, fake_runner_output(sched, out))


def test_requests_holding_a_failed_steps_blocks_fail_with_it() -> None:
    """Two steps in flight (async scheduling): the second admits a prompt on a prefix hit of
    blocks the first registered; when the first fails, the second's request fails too (it
    would compute on KV that is not there), and so does the first step's own request."""
    sched = make_scheduler(num_blocks=32, block_size=16, max_num_batched_tokens=64)
    sched.async_scheduling = True
    sched.add_request(make_request("a", prompt=P[:70], max_tokens=4))
    first = sched.schedule()  # a: tokens 0..63, 4 blocks registered
    sched.add_request(make_request("b", prompt=P[:64] + [7, 7, 7], max_tokens=4))
    second = sched.schedule()  # a: the rest of its prompt; b: a 64-token hit on a's blocks
    assert second.scheduled_new_reqs[0].num_computed_tokens == 64
    errors = sched.fail_step(first, "injected device fault")
    assert sorted(o.request_id for o in errors) == ["a", "b"]
    assert not sched.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert sched.fail_step(second, "injected device fault") == []
    sched.schedule()
    sched.assert_idle()


class FailOnce:
    """Patches a model runner: the first forward after `arm()` raises, before any KV is written
    (the runner has taken the step's requests in, as a device fault mid-step leaves it)."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.armed = False
        forward = runner._forward

        def failing_forward(inp):  # noqa: ANN001, ANN202
            if self.armed:
                self.armed = False
                raise RuntimeError("injected device fault")
            return forward(inp)

        runner._forward = failing_forward

    def arm(self) -> None:
        self.armed = True


@pytest.mark.parametrize(
    "async_scheduling,budget", [(False, 512), (True, 64)], ids=["sync", "batch-queue-two-steps-in-flight"]
)
def test_after_a_failed_prefill_the_prompt_gives_a_fresh_engines_tokens(async_scheduling: bool, budget: int) -> None:
    """The real default model, greedy, prefix caching on: the step prefilling P raises (with the
    batch queue, P's prefill spans both steps in flight). P then gives the tokens P gives with
    no prefix cache at all; the failed request ended with an error and the engine went on."""
    from engine.frontend.llm import LLM

    llm = LLM(model="smollm2", enable_prefix_caching=True, block_size=16, num_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=budget, async_scheduling=async_scheduling)  # fmt: skip
    core = llm.engine_core
    fail = FailOnce(core._runner)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fail.arm()
    failed = llm.generate([P], params, use_tqdm=False)[0].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    after = llm.generate([P], params, use_tqdm=False)[0]
    core.scheduler.assert_idle()
    assert llm.engine_core.reset_prefix_cache()
    fresh = llm.generate([P], params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids, (after.num_cached_tokens, "tokens differ")
