"""The sampler on the logits' device: seeded noise, penalties and masks.

Every test runs on the CPU and, marked `gpu`, on a CUDA GPU with the same code: the
runner keeps CPU `torch.Generator`s per seeded request while the logits live on the
GPU, and penalty ids come from host lists, so the device run is where mixed devices
would fail (issue 13, defect 2). On the CPU the same path pins the values the GPU run
must reproduce: a seed's noise is its generator's own stream, whatever device samples.
"""

from __future__ import annotations

import pytest
import torch

from engine.sample.inverse_cdf import uniforms
from engine.sample.sampler import Sampler, SamplingBatch, apply_penalties
from engine.sampling_params import SamplingParams

VOCAB = 512

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")],
    ),
]


def random_logits(rows: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).to(device)  # [rows, V] float32


def seeded(seed: int) -> torch.Generator:
    """A CPU generator, as engine/worker/input_batch.py makes one per seeded request."""
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_uniform_rows_are_their_generators_own_stream(device: str) -> None:
    """Row i takes counts[i] values of its generator (the rest of the row is zero), on the
    sampling device: the same values whatever device samples."""
    u = uniforms([None, seeded(7), None, seeded(9)], [1, 2, 2, 1], torch.device(device))
    assert u.device.type == device and u.shape == (4, 2) and u.dtype == torch.float64
    for row, seed, count in ((1, 7, 2), (3, 9, 1)):
        expected = torch.rand(count, dtype=torch.float64, generator=seeded(seed))
        assert torch.equal(u[row, :count].cpu(), expected)
        assert bool((u[row, count:] == 0).all())
    assert bool(((u[[0, 2]] >= 0) & (u[[0, 2]] < 1)).all())


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_samples_the_same_alone_in_a_batch_and_across_runs(device: str) -> None:
    sampler = Sampler()
    logits = random_logits(3, device, seed=1)
    target = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11)
    neighbours = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.3, min_p=0.05, seed=5, presence_penalty=0.5),
    ]

    def run(batched: bool) -> list[int]:
        gens = [seeded(11), None, seeded(5)] if batched else [seeded(11)]
        tokens = []
        for _ in range(20):  # the generator advances step after step
            if batched:
                batch = SamplingBatch([target, *neighbours], gens, [[1, 2]] * 3, [[3], [4], [5]])
                ids, _ = sampler.sample(logits, batch)
            else:
                batch = SamplingBatch([target], gens, [[1, 2]], [[3]])
                ids, _ = sampler.sample(logits[:1], batch)
            tokens.append(ids[0])
        return tokens

    alone = run(batched=False)
    assert run(batched=True) == alone
    assert run(batched=False) == alone
    assert len(set(alone)) > 1  # it does sample, not argmax


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_on_device_match_a_hand_computation(device: str) -> None:
    logits = random_logits(2, device, seed=2)
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(frequency_penalty=1.0),
    ]
    prompt, output = [[10, 11, 12], [1]], [[12, 12, 40, 41], [7, 7, 7]]
    batch = SamplingBatch(params, [None, None], prompt, output)
    got = apply_penalties(logits.clone(), batch)
    assert got.device == logits.device

    expected = logits.cpu().clone()
    for i, p in enumerate(params):
        for t in set(prompt[i] + output[i]):
            x = expected[i, t]
            if p.repetition_penalty != 1.0:
                expected[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output[i]):
            expected[i, t] -= p.frequency_penalty * output[i].count(t) + p.presence_penalty
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_every_option_samples_inside_its_mask_with_logprobs(device: str) -> None:
    sampler = Sampler()
    logits = random_logits(4, device, seed=3)
    params = [
        SamplingParams(top_k=5, seed=1, logprobs=2),
        SamplingParams(top_p=0.3, seed=2, logprobs=0),
        SamplingParams(min_p=0.2, seed=3),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    cpu = logits.cpu()
    probs = torch.softmax(cpu, dim=-1)
    allowed = [
        set(cpu[0].topk(5).indices.tolist()),
        _nucleus(probs[1], 0.3),
        set(torch.nonzero(probs[2] >= probs[2].max() * 0.2).flatten().tolist()),
        {int(cpu[3].argmax())},
    ]
    for step in range(10):
        gens = [seeded(1 + step), seeded(2 + step), seeded(3 + step), None]
        ids, logprobs = sampler.sample(logits, SamplingBatch(params, gens))
        for i, token in enumerate(ids):
            assert token in allowed[i], (i, token)
        assert logprobs[2] is None
        token, lp, tops = logprobs[0]
        assert token == ids[0] and len(tops) == 2
        assert lp == pytest.approx(float(torch.log_softmax(cpu[0], -1)[token]), abs=1e-5)
        assert logprobs[1][2] == [] and logprobs[3][0] == ids[3] and len(logprobs[3][2]) == 3


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches top_p (ties aside)."""
    order = probs.argsort(descending=True)
    keep, mass = set(), 0.0
    for t in order.tolist():
        keep.add(t)
        mass += float(probs[t])
        if mass >= top_p:
            break
    return keep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_seeded_tokens_on_cuda_equal_those_on_cpu() -> None:
    """Temperature and top-k (exact masks) with CPU-seeded noise: the device only changes where it runs."""
    sampler = Sampler()
    logits = random_logits(3, "cpu", seed=4)
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(top_k=20, seed=2),
        SamplingParams(seed=3),
    ]
    runs = {}
    for device in ("cpu", "cuda"):
        gens: list[torch.Generator | None] = [seeded(1), seeded(2), seeded(3)]
        runs[device] = [sampler.sample(logits.to(device), SamplingBatch(params, gens))[0] for _ in range(10)]
    assert runs["cuda"] == runs["cpu"]
