"""The simulated executor leaves the scheduler's decisions unchanged.

One fixed workload (token-id prompts, ignore_eos, greedy) runs through an EngineCore twice:
once on the real in-process executor with the default model (SmolLM2, cut to 2 layers to
keep the test cheap: with ignore_eos the scheduler's decisions depend only on token counts,
never on the logits), once on a `SimulatedExecutor`. A small token budget makes prompts
chunk and a small KV cache forces preemptions; the per-step scheduled token counts per
request must be identical, and so must the preemption counts and finished outputs.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreRequest
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from engine.sim.model_counts import load_arch

NUM_BLOCKS = 14  # 224 token slots for 6 requests of up to 70 tokens: preemption is certain
BUDGET = 32  # prompts of 24..59 tokens chunk


def _config() -> EngineConfig:
    cfg = EngineConfig.from_kwargs("smollm2", max_num_batched_tokens=BUDGET, max_num_seqs=8)
    cfg.model.num_layers_override = 2
    cfg.cache.num_blocks = NUM_BLOCKS
    return cfg


def _requests() -> list[EngineCoreRequest]:
    reqs = []
    for i in range(6):
        prompt, out = 24 + 7 * i, 12 - i
        ids = [(100 + 13 * i + 3 * j) % 40000 + 10 for j in range(prompt)]  # distinct prompts, no eos
        params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
        reqs.append(EngineCoreRequest(f"r{i}", ids, params, 2, float(i), out))
    return reqs


def _trace(core: EngineCore) -> tuple[list[dict[str, int]], dict[str, int], int]:
    """Steps' scheduled tokens per request; output tokens per request; preemptions."""
    schedule = core.scheduler.schedule
    steps: list[dict[str, int]] = []

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    pending = _requests()
    produced: dict[str, int] = {}
    preemptions = 0
    # Two requests arrive after the first steps, mid-run, as in a replayed trace.
    for req in pending[:4]:
        core.add_request(req)
    n = 0
    while core.has_unfinished_requests() or n < 3:
        if n == 3:
            for req in pending[4:]:
                core.add_request(req)
        out = core.step()
        preemptions += out.stats.num_preemptions if out.stats else 0
        for o in out.outputs:
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
        n += 1
        assert n < 500
    return [s for s in steps if s], produced, preemptions


def test_simulated_executor_schedules_like_the_real_one() -> None:
    real_core = EngineCore(_config())
    real = _trace(real_core)
    cfg = _config()
    model = CalibratedStepModel(0.01, {"num_prefill_tokens": 1e-4, "num_decode_reqs": 1e-3})
    sim = _trace(EngineCore(cfg, executor=SimulatedExecutor(cfg, model, load_arch("smollm2"))))
    real_steps, real_out, real_preempt = real
    sim_steps, sim_out, sim_preempt = sim
    assert real_preempt > 0  # the workload does exercise preemption ...
    assert any(0 < n < 24 for s in real_steps for n in s.values())  # ... and chunked prefill
    assert sim_steps == real_steps
    assert sim_out == real_out == {f"r{i}": 12 - i for i in range(6)}
    assert sim_preempt == real_preempt
    real_core.scheduler.assert_idle()
