"""A step whose executor raises leaves nothing behind (issue 13, defect 1).

Before the fix the scheduler marked the step's requests in flight, the caller aborted
them, and the abort deferred their blocks to an `update_from_output` that never came
for the failed step: the KV cache leaked every block of every scheduled request.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore, EngineCoreRequest
from engine.model.arch import ModelArch
from engine.sampling_params import SamplingParams
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
