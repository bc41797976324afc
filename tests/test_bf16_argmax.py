"""Greedy ids from bfloat16 logits on a CPU (LlamaForCausalLM.greedy_ids without the AMX LM head):
near-ties that bfloat16 rounding makes exact are settled by float32 dot products."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model import llama
from engine.model.arch import ModelArch
from engine.model.llama import LlamaForCausalLM

VOCAB, HIDDEN = 300, 64


def _model() -> LlamaForCausalLM:
    arch = ModelArch(hidden_size=HIDDEN, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=VOCAB, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(arch, TorchAttentionBackend()).bfloat16()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    return model


@pytest.fixture(params=["fused", "torch"])
def candidates(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of finding the near-maximum candidates: the fused kernel, and torch ops (where
    no C++ toolchain builds the kernels)."""
    if request.param == "torch":
        monkeypatch.setattr(llama, "kernels", lambda: None)
    return str(request.param)


@torch.inference_mode()
def test_a_tie_made_by_rounding_goes_to_the_larger_float32_score(candidates: str) -> None:
    model = _model()
    w = model.model.embed_tokens.weight
    # hidden . w[3] = 34.375 and hidden . w[7] = 34.578125 (exact in float32): both round to 34.5
    # in bfloat16, where the first index (3) would win.
    w[3, :2] = torch.tensor([1.0, 2.375])
    w[7, :2] = torch.tensor([1.0, 2.578125])
    w[250, 2] = 1.0  # row 1's clear winner
    hidden = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    hidden[0, :2] = torch.tensor([32.0, 1.0])
    hidden[1, 2] = 4.0
    logits = model.compute_logits(hidden, upcast=False)
    assert logits[0, 3] == logits[0, 7] == 34.5 and int(logits[0].max(dim=-1).indices) == 3
    ids = model.greedy_ids(hidden)
    assert ids is not None and ids.tolist() == [7, 250]
    # equal float32 scores: the first index, as argmax
    w[7, :2] = torch.tensor([1.0, 2.375])
    assert model.greedy_ids(hidden).tolist() == [3, 250]  # type: ignore[union-attr]


@torch.inference_mode()
def test_clear_winners_and_nan_rows_keep_the_plain_argmax(candidates: str) -> None:
    model = _model()
    torch.manual_seed(0)
    model.model.embed_tokens.weight.copy_(torch.randn(VOCAB, HIDDEN))
    hidden = torch.randn(5, HIDDEN).bfloat16()
    hidden[2] = float("nan")
    want = model.compute_logits(hidden, upcast=False).max(dim=-1).indices
    exact = (hidden.float() @ model.model.embed_tokens.weight.float().T).argmax(dim=-1)
    got = model.greedy_ids(hidden)
    assert got is not None and got[2] == want[2]  # NaN: the plain argmax's index
    keep = torch.tensor([0, 1, 3, 4])
    assert torch.equal(got[keep], exact[keep])
    # float32 models: the sampler's argmax (None)
    assert model.float().greedy_ids(hidden.float()) is None


@torch.inference_mode()
def test_a_row_with_more_candidates_than_the_kernel_lists_is_settled_too(candidates: str) -> None:
    """A row whose logits all tie in bfloat16 (more candidates than NEAR_MAX_CANDIDATES): the
    float32 scores decide, as for a row of two."""
    model = _model()
    w = model.model.embed_tokens.weight
    w[:, 0] = 1.0  # every logit of row 0 is 32 in bfloat16 ...
    w[123, 1] = 2.0**-4  # ... and token 123's float32 score 32.0625 is the largest
    hidden = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    hidden[0, :2] = torch.tensor([32.0, 1.0])
    hidden[1, 0] = 1.0  # row 1: all tied exactly, also in float32: the first index
    assert int((model.compute_logits(hidden, upcast=False)[0] == 32).sum()) == VOCAB
    assert model.greedy_ids(hidden).tolist() == [123, 0]  # type: ignore[union-attr]
