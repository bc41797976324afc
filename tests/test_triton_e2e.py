"""End to end: a small dummy-weight model generates the same greedy tokens with
`attention=triton` (under TRITON_INTERPRET=1 on a CPU) as with `attention=torch`.

The batch mixes chunked prefill (a budget smaller than the prompts), decode, and a prefix
hit (an exact repeat of a prompt), so every path of the Triton kernels runs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from engine.frontend.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    list(range(100, 137)),  # 37 tokens: crosses block boundaries
    list(range(500, 509)),
    list(range(100, 137)),  # exact repeat: a prefix hit
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
]


def _generate(backend: str) -> tuple[list[list[int]], int]:
    torch.manual_seed(0)
    llm = LLM(
        model="smollm2", load_format="dummy", num_layers_override=2, dtype="float32",
        attention_backend=backend, block_size=16, num_blocks=64, max_num_batched_tokens=24,
        max_num_seqs=4, enable_prefix_caching=True, seed=0,
    )
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        llm.engine_core.scheduler.assert_idle()
        hits = sum(s.prefix_cache_hits for s in llm.step_stats)
    finally:
        llm.engine_core.shutdown()
    return [o.outputs[0].token_ids for o in outs], hits


def test_triton_backend_generates_the_same_tokens_as_torch() -> None:
    ref, ref_hits = _generate("torch")
    got, hits = _generate("triton")
    assert got == ref
    assert hits > 0 and hits == ref_hits
    assert all(len(t) == 5 for t in got)
