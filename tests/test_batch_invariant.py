"""`model.batch_invariant` (engine/model/batch_invariance.py): a row's results do not depend on
which other rows share its step: the paged-attention op's rows alone against the same rows in one
call, and greedy requests alone against the same requests in a batch of 16 under a token budget
that chunks their prompts differently (the default model, bfloat16, AMX or AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_paged_attention import paged_attention_op
from engine.model.batch_invariance import machine_lacks, planned_step_weights

LACKS = machine_lacks()
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"model.batch_invariant needs {LACKS}")

WORDS = ["the", "river", "city", "old", "machine", "music", "garden", "winter", "letter", "bright", "quiet", "north", "story", "mountain", "silver", "paper", "window", "friend", "market", "harbour"]
PROMPTS = [f"Write about {WORDS[i]}" + " and".join(f" {w}" for w in WORDS[: (i * 7) % 13]) + "." for i in range(20)]
BUDGET = 48  # tokens a step: every prompt fits alone, sixteen of them are chunked where they fall


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])  # SmolLM2's heads; Llama-3-8B's (Hq > 16)
def test_paged_attention_rows_alone_equal_rows_in_one_call(hq, hkv, d) -> None:  # type: ignore[no-untyped-def]
    """Prefill and decode rows of five requests in one call (more rows than 4 x threads: the
    split that used to follow the row count) equal, bit for bit, each row asked alone as a
    one-row query over its own context."""
    torch.manual_seed(hq)
    bs, nblk = 16, 6
    q_lens, seq_lens = [1, 37, 1, 12, 20], [50, 37, 81, 44, 90]
    cache = torch.randn(2, 5 * nblk, bs, hkv, d).bfloat16()
    table = torch.arange(5 * nblk).view(5, nblk)
    q = torch.randn(sum(q_lens), hq, d).bfloat16()
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    op = paged_attention_op()
    together = op(q, cache, table, qsl, torch.tensor(seq_lens), d**-0.5, True)
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for j in range(q_len):
            i = int(qsl[b]) + j
            alone = op(q[i : i + 1], cache, table[b : b + 1], torch.tensor([0, 1]),
                       torch.tensor([seq_len - q_len + j + 1]), d**-0.5, True)  # fmt: skip
            assert torch.equal(alone[0], together[i]), (b, j)


def _tokens(llm, prompts: list[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_greedy_tokens_alone_equal_tokens_in_a_batch_of_16() -> None:
    """20 prompts, each alone and inside a batch of 16 (prompts 0-15 and 4-19), greedy: the same
    16 tokens. The budget chunks the batches' prompts at other boundaries than alone (each fits
    one step alone), so prefill, decode and chunked-prefill rows all meet steps of other sizes;
    prefix caching is off, so every prompt is computed in each run. With the switch off, 12 of
    the 20 differed here (10 with the default budget of 2048; AMX, 2026-12-04)."""
    from engine import LLM

    llm = LLM(dtype="bfloat16", batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=BUDGET,
              num_blocks=256)  # fmt: skip
    model = llm.engine_core.executor.worker.model
    assert model.step_weights() == {"all": "bfloat16 (loader-rounded)"}
    assert planned_step_weights(llm.engine_core.config.model, "bfloat16") == model.step_weights()  # summary.json's
    lens = [len(llm.tokenizer.encode(p)) for p in PROMPTS]
    assert max(lens) <= BUDGET < sum(lens[:16]) // 4, lens  # alone: one chunk; batched: chunked
    alone = [_tokens(llm, [p])[0] for p in PROMPTS]
    for lo in (0, 4):
        batched = _tokens(llm, PROMPTS[lo : lo + 16])
        differ = [lo + i for i, toks in enumerate(batched) if toks != alone[lo + i]]
        assert not differ, f"prompts {differ} changed beside 15 others"


@pytest.mark.parametrize("kwargs,missing", [({"dtype": "float32"}, "bfloat16 on a CPU"),
                                            ({"enforce_eager": False}, "enforce_eager")])  # fmt: skip
def test_batch_invariant_refuses_what_it_cannot_hold(kwargs, missing) -> None:  # type: ignore[no-untyped-def]
    """A configuration whose kernels it cannot fix is a start-up error that names what is needed."""
    from engine import LLM

    with pytest.raises(ValueError, match=f"model.batch_invariant: needs {missing}"):
        LLM(batch_invariant=True, num_blocks=16, **{"dtype": "bfloat16", **kwargs})
