"""What a sampled step computes, op by op (issue 38, item 1): no timing, the work itself.

Before: every sampled step drew one exponential per token of the vocabulary (16 x 49,152 at
c=16: `aten::exponential_`, 38% of the CPU time of an offline run) and sorted every row for
top-k / top-p. Now a row takes one uniform (two with top-p), and no op sorts a row. A top-k
row draws among its candidates (engine/sample/top_k.py): the only tensor the size of the
logits it writes is their float32 copy.
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
    random_values = sum(n for name, n in log.ops if any(r in name for r in RANDOM_OPS))
    assert random_values <= 4 * ROWS, log.ops  # was ROWS x VOCAB exponentials
    # Never a row's worth: the top-k path sorts the indices of its k candidate sub-blocks.
    assert all(n <= 64 * 64 for name, n in log.ops if name in ("sort", "argsort", "topk"))


VIEWS = ("empty", "slice", "view", "alias", "expand", "as_strided", "select", "unsqueeze", "_unsafe_view")


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=20), SamplingParams(top_k=50, top_p=0.9, min_p=0.02, temperature=0.8)],
    ids=["top-k-20", "top-k-50-top-p-min-p"],
)
def test_a_top_k_step_writes_one_vocabulary_sized_tensor(params: SamplingParams) -> None:
    """Top-k (with top-p and min-p) is decided on its candidates (k + 16 sub-blocks of 64
    tokens: 36 and 66 of 256 here): the one full-size write is the logits' float32 copy (was
    also the weights' shift, exp, masks)."""
    vocab = 4 * VOCAB
    logits = (torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    with OpLog() as log:
        Sampler().sample(logits, SamplingBatch([params] * ROWS, [None] * ROWS))
    full = [name for name, n in log.ops if n >= ROWS * vocab and name not in VIEWS]
    assert full == ["copy_"], full
