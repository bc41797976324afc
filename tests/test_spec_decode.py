"""N-gram speculative decoding: proposer, verification, scheduler bookkeeping, the engine.

Exactness: greedy output with speculation equals greedy output without it, token for token
(oracle prompts and a repetitive workload; together, under chunked prefill and under
preemption); the rejection sampler's output distribution equals the target's (a seeded
statistical test: total-variation distance below 0.02 over 20,000 draws, where a sampler
that ignores rejection would be off by 0.7), and end to end, seeded sampling with speculation
has the token distribution of sampling without it (a chi-square test per position).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from sched_utils import make_request, make_scheduler, step
from test_oracle import PROMPTS, SYSTEM

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.frontend.llm import LLM
from engine.sample.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams
from engine.spec_decode.proposer import NgramProposer
from engine.spec_decode.verify import rejection_sample, sample_with_drafts, verify_drafts

pytestmark = pytest.mark.timeout(300)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

# tests/test_oracle.py's prompts without the two long system-prompt ones (the engine matches HF greedy on them) ...
ORACLE_PROMPTS = [p for p in PROMPTS if not p.startswith(SYSTEM)]
# ... and a repetitive workload: the continuation repeats what the prompt says.
REPETITIVE_PROMPTS = [
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
]


# ---- proposer ---------------------------------------------------------------------------------


def test_ngram_proposer_takes_the_longest_most_recent_match() -> None:
    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                        prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]  # the later "1 2 3"
    assert p.propose([5, 1, 2, 6, 4, 2, 6, 1, 2]) == [6, 4, 2]  # "1 2" beats the later "2"
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert p.propose([4, 5, 4]) == [5, 4]  # n=1, and drafts stop at the end of the tokens
    assert p.propose([1, 2, 1, 2, 1], k=1) == [2]


def test_proposer_respects_eligibility_and_limits() -> None:
    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    reqs = [make_request(str(i), prompt=[3, 4, 5, 3, 4, 5, 3, 4], max_tokens=3, **kw)
            for i, kw in enumerate([{}, {"logprobs": 1}, {"repetition_penalty": 1.2}])]
    sched = make_scheduler()
    for r in reqs:
        sched.add_request(r)
    step(sched)  # prefill: each samples one token (7)
    for r in reqs:
        r.all_token_ids[-1] = r.output_token_ids[-1] = 5  # continue the pattern: "... 3 4 5"
    p.propose_for(reqs, max_model_len=1000)
    assert reqs[0].spec_token_ids == [3]  # 1 of 3 outputs done; the last one is never a draft
    assert reqs[1].spec_token_ids == [] and reqs[2].spec_token_ids == []


def test_speculative_config_validation() -> None:
    with pytest.raises(ValueError, match="method"):
        EngineConfig.from_kwargs(speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key 'k'"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "k": 2})
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_kwargs(speculative_config=NGRAM, async_scheduling=True)
    cfg = EngineConfig.from_kwargs(speculative_config=NGRAM)
    assert cfg.speculative_config.enabled and cfg.speculative_config.prompt_lookup_max == 4


# ---- scheduler bookkeeping ----------------------------------------------------------------------


def test_scheduler_budgets_drafts_and_rolls_back_rejected_kv() -> None:
    sched = make_scheduler(block_size=4)
    req = make_request("r", 6, max_tokens=20)
    sched.add_request(req)
    step(sched)  # prefill 6, sample one: 7 tokens, 6 computed
    req.spec_token_ids = [1, 2, 3]
    assert req.num_tokens_with_spec == 10
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 4} and out.scheduled_spec_decode_tokens == {"r": [1, 2, 3]}
    assert req.num_computed_tokens == 10
    assert len(sched.kv_cache_manager.get_block_ids("r")) == 3  # KV slots for all candidates
    # The runner accepted draft 1 and rejected 2: tokens [1, 9] (9 = the correction).
    from sched_utils import fake_runner_output

    sched.update_from_output(out, fake_runner_output(sched, out, {"r": [1, 9]}))
    assert req.output_token_ids[-2:] == [1, 9]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8  # rejected slots given back
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (3, 1)
    stats = sched.make_stats()
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 1)
    assert stats.num_accepted_tokens_per_pos == [1]


def test_drafts_trimmed_to_the_budget_and_dropped_on_preemption() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=3)
    req = make_request("r", 2, max_tokens=20)
    sched.add_request(req)
    step(sched)
    req.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 3} and out.scheduled_spec_decode_tokens == {"r": [1, 2]}
    assert req.spec_token_ids == []
    sched.update_from_output(out, ModelRunnerOutputFor(out, {"r": [5]}))
    assert req.num_computed_tokens == req.num_tokens - 1
    req.spec_token_ids = [1]
    sched._preempt(req)
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0


def ModelRunnerOutputFor(out, tokens):  # noqa: N802 - reads like the type it builds
    from engine.step_io import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))


# ---- verification -------------------------------------------------------------------------------


def test_greedy_verification_accepts_while_equal() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([4, 5, 8, 2]):
        logits[row, tok] = 1.0
    greedy = SamplingParams(temperature=0.0)
    assert verify_drafts(logits, [4, 5, 6], greedy, None) == [4, 5, 8]  # third rejected, corrected
    assert verify_drafts(logits, [4, 5, 8], greedy, None) == [4, 5, 8, 2]  # all accepted + bonus
    assert verify_drafts(logits, [1, 5, 8], greedy, None) == [4]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Bound: with 20,000 draws the total-variation distance between the empirical and the
    target distribution has standard deviation under 0.006 here; the test allows 0.02 for
    the first token and 0.035 for the conditional second token (~6,000 draws)."""
    p0 = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15])
    p1 = torch.tensor([0.50, 0.10, 0.10, 0.20, 0.10])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    probs = torch.stack([p0, p1, p2])
    drafts = [2, 0]
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(n):
        out = rejection_sample(probs, drafts, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:  # the draft was accepted: the next token is drawn from p1
            second[out[1]] += 1

    def tv(counts: Counter[int], p: torch.Tensor) -> float:
        total = sum(counts.values())
        return 0.5 * sum(abs(counts[i] / total - float(p[i])) for i in range(len(p)))

    assert tv(first, p0) < 0.02
    assert tv(second, p1) < 0.035
    # The same seed gives the same draws.
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [rejection_sample(probs, drafts, g1) for _ in range(20)] == [rejection_sample(probs, drafts, g2)
                                                                          for _ in range(20)]


def test_verification_draws_from_what_the_plain_sampler_draws_from() -> None:
    """Temperature and top-k/top-p in the verifier equal the plain sampler's: the verifier's
    first-token distribution (4,000 draws, with a draft of a likely token and of an unlikely
    one) is within total variation 0.05 of the plain sampler's (20,000 draws); the distance's
    standard deviation here is about 0.01."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    n = 20_000
    batch = SamplingBatch(params=[params] * n, generators=[None] * n)
    plain_ids, _ = Sampler().sample(logits.repeat(n, 1), batch)
    plain = Counter(plain_ids)
    gen = torch.Generator().manual_seed(5)
    rows = logits.repeat(2, 1)  # [k + 1 = 2, V]
    m = 4_000
    for draft in (0, 3):
        verified = Counter(verify_drafts(rows, [draft], params, gen)[0] for _ in range(m))
        tv = 0.5 * sum(abs(plain[t] / n - verified[t] / m) for t in range(6))
        assert tv < 0.05, (draft, plain, verified)
        assert verified[5] == 0 and plain[5] == 0  # outside top-k in both


def test_sample_with_drafts_mixes_plain_and_speculated_rows() -> None:
    logits = torch.full((4, 6), -5.0)
    logits[0, 1] = 5.0  # request 0 (no drafts): one row
    logits[1, 2] = 5.0  # request 1: drafts [2, 3]; rows 1..3
    logits[2, 3] = 5.0
    logits[3, 4] = 5.0
    batch = SamplingBatch(params=[SamplingParams(temperature=0.0)] * 2, generators=[None, None])
    out, _ = sample_with_drafts(Sampler(), logits, batch, [[], [2, 3]])
    assert out == [[1], [2, 3, 4]]


# ---- the engine: greedy exactness -------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLM, LLM]]:
    kw = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 128, "max_num_seqs": 48}
    plain, spec = LLM(**kw), LLM(speculative_config=NGRAM, **kw)  # type: ignore[arg-type]
    yield plain, spec
    plain.engine_core.shutdown()
    spec.engine_core.shutdown()


def _greedy_ids(llm: LLM, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine_core.scheduler.assert_idle()
    return [o.outputs[0].token_ids for o in outs]


def _configure(llm: LLM, num_blocks: int = 128, **sched: object) -> None:
    llm.engine_core.reconfigure(SchedulerConfig(**{"max_num_seqs": 16, **sched}), CacheConfig(), num_blocks)  # type: ignore[arg-type]
    llm.reset_prefix_cache()
    llm.step_stats.clear()


@pytest.mark.parametrize(
    ("case", "num_blocks", "sched"),
    [
        ("together", 128, {}),
        ("chunked_prefill", 128, {"max_num_batched_tokens": 8}),
        ("preemption", 10, {}),
    ],
)
def test_greedy_with_speculation_equals_greedy_without(engines: tuple[LLM, LLM], case: str, num_blocks: int,
                                                       sched: dict) -> None:
    plain, spec = engines
    # Every oracle prompt together; a subset under the slower constraints.
    prompts = ORACLE_PROMPTS + REPETITIVE_PROMPTS if case == "together" else ORACLE_PROMPTS[:2] + REPETITIVE_PROMPTS
    for llm in engines:
        _configure(llm, num_blocks, **sched)
    expected = _greedy_ids(plain, prompts)
    got = _greedy_ids(spec, prompts)
    for prompt, e, g in zip(prompts, expected, got, strict=True):
        assert g == e, prompt
    stats = spec.step_stats
    drafts, accepted = sum(s.num_draft_tokens for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert accepted > 0 and drafts >= accepted
    if case == "together":  # the first repetitive request needs fewer steps than tokens
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        steps = [len(set(llm.generate(REPETITIVE_PROMPTS[:1], params, use_tqdm=False)[0].metrics.token_times))
                 for llm in engines]
        assert steps[0] == 16 and steps[1] < 10, steps
    if case == "chunked_prefill":
        assert max(s.num_prefill_tokens + s.num_decode_tokens + s.num_draft_tokens for s in stats) <= 8
    if case == "preemption":
        assert sum(s.num_preemptions for s in stats) > 0


def test_sampled_with_speculation_runs_seeded_and_reproducible(engines: tuple[LLM, LLM]) -> None:
    _, spec = engines
    _configure(spec)
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=11, ignore_eos=True)
    a = spec.generate(REPETITIVE_PROMPTS[::2], params, use_tqdm=False)
    b = spec.generate(REPETITIVE_PROMPTS[::2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 16 for o in a)
    assert sum(s.num_accepted_tokens for s in spec.step_stats) > 0


def _chi2_homogeneity_p(a: Counter[int], b: Counter[int], min_pooled: int = 10) -> float:
    """p-value of Pearson's chi-square test that two samples come from one distribution
    (categories with fewer than `min_pooled` draws in both samples together are lumped into one)."""
    pooled = a + b
    cats = [t for t, c in pooled.items() if c >= min_pooled]
    rows = [[a[t] for t in cats] + [sum(a.values()) - sum(a[t] for t in cats)],
            [b[t] for t in cats] + [sum(b.values()) - sum(b[t] for t in cats)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_with_speculation_has_the_distribution_without(engines: tuple[LLM, LLM]) -> None:
    """End to end: 400 seeded requests per engine (temperature 1.2) on a repetitive prompt, so
    drafts are proposed from the first decode step on and rejection sampling runs at tokens 2-4.
    Each position's token distribution with speculation must pass a chi-square homogeneity test
    against the one without (p > 0.001 at each of 4 positions: a family-wise false-alarm bound
    of 0.4% for a correct sampler; the seeds are fixed, so the outcome is deterministic).
    Power: the plain engine's most likely token at positions 2-4 has at most 90% of the draws
    (asserted), so a verifier that accepted every draft would shift a category by >= 10 points,
    about 5 standard deviations at n = 400."""
    plain, spec = engines
    n, positions = 400, 4
    prompt = REPETITIVE_PROMPTS[0]
    samples = []
    for llm in engines:
        _configure(llm, max_num_seqs=48)
        params = [SamplingParams(max_tokens=positions, temperature=1.2, seed=1000 + i, ignore_eos=True)
                  for i in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        llm.engine_core.scheduler.assert_idle()
        samples.append([o.outputs[0].token_ids for o in outs])
    stats = spec.step_stats
    drafts, accepted = sum(s.num_draft_tokens for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert 0 < accepted < drafts  # drafts were both accepted and rejected
    for pos in range(positions):
        a = Counter(ids[pos] for ids in samples[0])
        b = Counter(ids[pos] for ids in samples[1])
        p_value = _chi2_homogeneity_p(a, b)
        print(f"position {pos}: p={p_value:.3f} plain {a.most_common(4)} spec {b.most_common(4)}")
        assert p_value > 1e-3, (pos, a.most_common(5), b.most_common(5))
        if pos > 0:
            assert a.most_common(1)[0][1] <= 0.9 * n, (pos, a.most_common(3))


# ---- measurement --------------------------------------------------------------------------------


def test_spec_metrics_in_steps_requests_and_prometheus() -> None:
    from analysis.record import RequestRecord
    from analysis.runfolder import request_row, steps_frame
    from engine.metrics.prometheus import PrometheusMetrics
    from engine.seam import StepStats

    stats = [StepStats(step=0, time=1.0, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                       num_accepted_tokens_per_pos=[2, 1]),
             StepStats(step=1, time=2.0)]
    frame = steps_frame(stats, t0_wall=0.0)
    assert frame["spec_acceptance_rate"].tolist()[0] == 0.5
    assert frame["num_accepted_tokens_per_pos"].tolist() == ["[2, 1]", "[]"]
    assert frame["spec_mean_accepted_length"].tolist()[0] == 2.5  # 1 + 3 accepted / 2 requests
    assert frame["spec_acceptance_rate"].isna().tolist() == [False, True]
    from analysis.metrics import step_summary
    from reports.sections_engine import _speculation_figure

    summary = step_summary(frame)
    assert summary["spec_decode_acceptance_rate"] == 0.5 and summary["spec_decode_mean_acceptance_length"] == 2.5
    assert "spec_decode_acceptance_rate" not in step_summary(frame.iloc[1:])

    assert _speculation_figure(frame, frame["time"]) is not None  # acceptance over time in the report
    assert _speculation_figure(frame.iloc[1:], frame["time"].iloc[1:]) is None  # no drafts: no figure
    row = request_row(RequestRecord(request_id="r", scheduled_s=0.0, start_s=0.0, token_times=[1.0],
                                    spec_draft_tokens=8, spec_accepted_tokens=6))
    assert (row["spec_draft_tokens"], row["spec_accepted_tokens"], row["spec_acceptance_rate"]) == (8, 6, 0.75)
    metrics = PrometheusMetrics("m")
    for s in stats:
        metrics.on_step(s)
    text = metrics.render().decode()
    for name, value in (("vllm:spec_decode_num_drafts_total", 2.0), ("vllm:spec_decode_num_draft_tokens_total", 6.0),
                        ("vllm:spec_decode_num_accepted_tokens_total", 3.0),
                        ("vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",position=\"1\"}", 1.0)):
        line = next(ln for ln in text.splitlines() if ln.startswith(name if name.endswith("}") else name + "{"))
        assert float(line.rsplit(" ", 1)[1]) == value, line


def test_engine_outputs_carry_per_request_spec_counts(engines: tuple[LLM, LLM]) -> None:
    _, spec = engines
    _configure(spec)
    out = spec.generate(REPETITIVE_PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    m = out.metrics
    assert m.num_draft_tokens >= m.num_accepted_tokens > 0
    assert m.num_accepted_tokens == sum(s.num_accepted_tokens for s in spec.step_stats)
