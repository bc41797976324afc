"""EngineCore.reconfigure over a loaded model: finished requests still leave the model runner."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams


def test_reconfigure_between_runs_does_not_leak_the_persistent_batch() -> None:
    llm = LLM(model="smollm2", load_format="dummy", num_layers_override=1, max_num_seqs=2, num_blocks=32)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        for budget in (8, 16, 32, 64):  # more rounds than the runner's batch has rows
            llm.engine_core.reconfigure(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=2),
                                        CacheConfig(num_blocks=32))
            outs = llm.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13]], params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
            llm.engine_core.scheduler.assert_idle()
        llm.engine_core.reconfigure()  # hands the last finished ids to the runner
        assert len(llm.engine_core.executor.model_runner.batch) == 0
    finally:
        llm.engine_core.shutdown()
