"""`model.batch_invariant` (engine/kernels/batch_invariance.py): a row's results do not depend on
which other rows share its step: the paged-attention op's rows alone against the same rows in one
call, and greedy requests alone against the same requests in a batch of 16 under a token budget
that chunks their prompts differently (the default model, bfloat16, AMX or AVX512-BF16).

Each test skips only where it needs what this machine lacks, and says what: the attention test
needs the C++ paged-attention op (any x86-64 CPU that builds it); the greedy tests need AMX or
AVX512-BF16 for the decode kernels; the refusals need neither (issue 60 item 10: the module used
to skip whole on an AVX2-only CPU, its refusal tests included).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.batch_invariance import machine_lacks
from engine.kernels.paged_attention import paged_attention_op
from engine.model.loader import planned_step_weights


def _needs_decode_kernels() -> None:
    """Skip, naming the instruction sets, on a CPU without the decode kernels the switch runs."""
    lacks = machine_lacks()
    if lacks is not None:
        pytest.skip(f"model.batch_invariant needs {lacks}")


WORDS = ["the", "river", "city", "old", "machine", "music", "garden", "winter", "letter", "bright", "quiet", "north", "story", "mountain", "silver", "paper", "window", "friend", "market", "harbour"]
PROMPTS = [f"Write about {WORDS[i]}" + " and".join(f" {w}" for w in WORDS[: (i * 7) % 13]) + "." for i in range(20)]
BUDGET = 48  # tokens a step: every prompt fits alone, sixteen of them are chunked where they fall


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])  # SmolLM2's heads; Llama-3-8B's (Hq > 16)
def test_paged_attention_rows_alone_equal_rows_in_one_call(hq, hkv, d) -> None:  # type: ignore[no-untyped-def]
    """Prefill and decode rows of five requests in one call (more rows than 4 x threads: the
    split that used to follow the row count) equal, bit for bit, each row asked alone as a
    one-row query over its own context."""
    op = paged_attention_op()
    if op is None:
        pytest.skip("needs the C++ paged-attention op (engine/kernels/csrc), which did not build on this machine")
    torch.manual_seed(hq)
    bs, nblk = 16, 6
    q_lens, seq_lens = [1, 37, 1, 12, 20], [50, 37, 81, 44, 90]
    cache = torch.randn(2, 5 * nblk, bs, hkv, d).bfloat16()
    table = torch.arange(5 * nblk).view(5, nblk)
    q = torch.randn(sum(q_lens), hq, d).bfloat16()
    qsl = torch.tensor([0] + q_lens).cumsum(0)
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
    the 20 differed here (10 with the default budget of 2048; AMX, 2026-12-04): the negative
    control below holds that figure."""
    from engine import LLM

    _needs_decode_kernels()
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


def test_greedy_tokens_differ_with_the_switch_off() -> None:
    """The negative control: the same prompts, budget and batches with `batch_invariant` off change
    some prompts' tokens (the kernels then follow the step's row count), so the test above can
    see what it guards against. Where it holds: the CPUs with the decode kernels, whose step-size
    choices (quant blocks up to 10 rows, the decode kernels' packs, oneDNN) the switch pins."""
    from engine import LLM

    _needs_decode_kernels()
    llm = LLM(dtype="bfloat16", batch_invariant=False, enable_prefix_caching=False, max_num_batched_tokens=BUDGET,
              num_blocks=256)  # fmt: skip
    alone = [_tokens(llm, [p])[0] for p in PROMPTS]
    differ = [lo + i for lo in (0, 4) for i, toks in enumerate(_tokens(llm, PROMPTS[lo : lo + 16]))
              if toks != alone[lo + i]]  # fmt: skip
    assert differ, "with the switch off no prompt changed beside 15 others: the invariance test proves nothing here"


@pytest.mark.parametrize("kwargs,missing", [({"dtype": "float32"}, "bfloat16 on a CPU"),
                                            ({"enforce_eager": False}, "enforce_eager")])  # fmt: skip
def test_batch_invariant_refuses_what_it_cannot_hold(kwargs, missing) -> None:  # type: ignore[no-untyped-def]
    """A configuration whose kernels it cannot fix is a start-up error that names what is needed."""
    from engine import LLM

    with pytest.raises(ValueError, match=f"model.batch_invariant: needs {missing}"):
        LLM(batch_invariant=True, num_blocks=16, **{"dtype": "bfloat16", **kwargs})


def test_batch_invariant_refuses_a_cpu_without_its_kernels() -> None:
    """Where the decode kernels are missing (an AVX2-only CPU), asking for the switch is a start-up
    error naming the instruction sets, not a run whose rows quietly depend on their neighbours."""
    from engine import LLM

    lacks = machine_lacks()
    if lacks is None:
        pytest.skip("this CPU has AMX or AVX512-BF16: the switch runs here (the tests above)")
    with pytest.raises(ValueError, match="model.batch_invariant: needs ") as err:
        LLM(batch_invariant=True, num_blocks=16, dtype="bfloat16")
    assert str(err.value) == f"model.batch_invariant: needs {lacks}"
    assert "AMX" in lacks and "AVX512-BF16" in lacks or "paged-attention" in lacks, lacks
