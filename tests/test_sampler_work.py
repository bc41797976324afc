"""What a sampled step computes, op by op (issue 38, item 1): no timing, the work itself.

Before: every sampled step drew one exponential per token of the vocabulary (16 x 49,152 at
c=16: `aten::exponential_`, 38% of the CPU time of an offline run) and sorted every row for
top-k / top-p. Now a row takes one uniform (two with top-p), and no op sorts a row.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.sample.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams

ROWS, VOCAB = 16, 4096
RANDOM_OPS = ("exponential", "uniform", "rand", "normal", "bernoulli", "multinomial", "random_")


class OpLog(TorchDispatchMode):
    """Records each aten op's name and the number of values it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, tuple | list) and out else out
        self.ops.append((str(func.overloadpacket.__name__), first.numel() if isinstance(first, torch.Tensor) else 0))
        return out


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(top_p=0.95), SamplingParams(top_k=50),
     SamplingParams(top_k=50, top_p=0.9, min_p=0.02, temperature=0.8)],
    ids=["temperature", "top-p", "top-k", "all"],
)
def test_a_sampled_step_draws_a_few_uniforms_a_row_and_sorts_nothing(params: SamplingParams) -> None:
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    gens: list[torch.Generator | None] = [None] * (ROWS // 2) + [torch.Generator().manual_seed(i) for i in range(ROWS // 2)]
    sampler = Sampler()
    with OpLog() as log:
        sampler.sample(logits, SamplingBatch([params] * ROWS, gens))
    names = [name for name, _ in log.ops]
    random_values = sum(n for name, n in log.ops if any(r in name for r in RANDOM_OPS))
    assert random_values <= 4 * ROWS, log.ops  # was ROWS x VOCAB exponentials
    assert "sort" not in names and "argsort" not in names
    assert all(n <= 64 * 64 for name, n in log.ops if name == "topk")  # never a row's worth
