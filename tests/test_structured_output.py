"""Structured output: request fields, grammar checks, bitmasks, the manager, and the engine.

Engine tests run the default model offline (one LLM for the module, its KV cache shrunk
with `reconfigure` for the preemption case). The OpenAI-client acceptance test (20 schemas,
streaming and not) is in test_structured_output_server.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from json_schemas import SCHEMAS, validate

from engine.config import CacheConfig, SchedulerConfig
from engine.frontend.llm import LLM
from engine.frontend.processor import fan_out
from engine.sample.logits_mask import apply_bitmask, unpack_bitmask
from engine.sampling_params import SamplingParams
from engine.structured_output import grammar
from engine.structured_output.params import StructuredOutputsParams, from_request_fields

pytestmark = pytest.mark.timeout(300)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


# ---- request fields -------------------------------------------------------------------------


def test_response_format_shapes() -> None:
    assert from_request_fields({"type": "text"}) is None
    assert from_request_fields({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    p = from_request_fields({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert p is not None and json.loads(p.json or "") == PERSON
    assert from_request_fields(guided_json=json.dumps(PERSON)) == p
    assert from_request_fields(guided_choice=["a", "b"]) == StructuredOutputsParams(choice=["a", "b"])
    assert from_request_fields(guided_regex="[0-9]+").regex == "[0-9]+"  # type: ignore[union-attr]
    assert from_request_fields(guided_grammar='start: "x"').grammar == 'start: "x"'  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_bad_request_fields_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        from_request_fields(**kwargs)


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar='start: "a"')
    # A dict in SamplingParams (as over the wire) becomes the dataclass.
    sp = SamplingParams(structured_outputs={"choice": ["x"]})  # type: ignore[arg-type]
    assert sp.structured_outputs == StructuredOutputsParams(choice=["x"])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(json={"type": "objectx"}), "response_format"),  # type: ignore[arg-type]
        (StructuredOutputsParams(regex="(unclosed"), "guided_regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "guided_grammar"),
    ],
)
def test_invalid_grammars_are_one_line_errors(params: StructuredOutputsParams, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: invalid") as info:
        grammar.check(params)
    assert "\n" not in str(info.value)


def test_valid_grammars_pass() -> None:
    for params in (
        StructuredOutputsParams(json=PERSON),  # type: ignore[arg-type]
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="[0-9]{3}"),
        StructuredOutputsParams(choice=['say "hi"', "no"]),
        StructuredOutputsParams(grammar='start: "a" | "b"'),
    ):
        assert grammar.check(params)


# ---- bitmask --------------------------------------------------------------------------------


def test_a_grammar_in_error_gets_a_row_as_wide_as_the_others() -> None:
    """Found by the API fuzzer: a request whose grammar allows nothing more (only EOS) and a
    healthy one in the same step made rows of different widths, and the step failed (500)."""
    from sched_utils import make_request

    from engine.config import ModelConfig
    from engine.structured_output.manager import StructuredOutputManager
    from engine.tokenizer import get_tokenizer

    tok = get_tokenizer(ModelConfig())
    manager = StructuredOutputManager(lambda: (tok.backend.to_str(), tok.eos_token_id))
    try:
        requests = {}
        for rid in ("ok", "stuck"):
            req = make_request(rid, 4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
            req.num_computed_tokens = req.num_tokens
            requests[rid] = req
            manager.submit(req)
        # wait_for_any consumes the "a compile finished" signal: take what is ready after each
        # wait (a second wait before take_ready sat out its whole timeout, 60 s)
        ready: list = []
        failed: list = []
        while manager.num_awaiting:
            manager.wait_for_any(timeout=60)
            now_ready, now_failed = manager.take_ready()
            ready += now_ready
            failed += now_failed
        assert not failed and sorted(r.request_id for r in ready) == ["ok", "stuck"]
        done = tok.encode("yes", add_special_tokens=False)
        manager.accept_tokens("stuck", done, finished=False)  # the choice is complete: only EOS remains
        manager._matchers["stuck"].consume_tokens(done[:1])  # one token past the end: an error state
        rows = manager.fill_bitmask(["ok", "stuck"], requests)
        assert rows is not None and rows["ok"].shape == rows["stuck"].shape
        np.stack(list(rows.values()))  # what the model runner does with them
        allowed = unpack_bitmask(rows["stuck"][None], tok.vocab_size, torch.device("cpu"))[0]
        assert allowed.nonzero().flatten().tolist() == [requests["stuck"].eos_token_id]
    finally:
        manager.shutdown()


def test_bitmask_unpack_and_apply() -> None:
    vocab = 70  # wider than the mask's 64 bits: tokens past it are disallowed
    words = np.zeros((2, 2), dtype=np.int32)
    words[0, 0] = 1 << 3  # token 3
    words[0, 1] = np.int32(np.uint32(1 << 31).view(np.int32))  # token 63 (the sign bit)
    words[1, 1] = 1 << 1  # token 33
    allowed = unpack_bitmask(words, vocab, torch.device("cpu"))
    assert allowed.shape == (2, vocab)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [3, 63]
    assert torch.nonzero(allowed[1]).flatten().tolist() == [33]
    logits = torch.randn(3, vocab)
    masked = apply_bitmask(logits, torch.tensor([2, 0]), words)
    assert torch.equal(masked[1], logits[1])  # an unconstrained row is untouched
    assert masked[2].argmax().item() == 3 or masked[2, 63] >= masked[2, 3]
    assert torch.isinf(masked[2]).sum().item() == vocab - 2
    assert torch.isinf(masked[0]).sum().item() == vocab - 1 and masked[0, 33] == logits[0, 33]


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=64)
    yield engine
    engine.engine_core.shutdown()


def _params(so: StructuredOutputsParams, **kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 0.0, "structured_outputs": so, **kw})  # type: ignore[arg-type]


def _chat(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[str]:
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
    return [o.outputs[0].text for o in outs]


def test_json_schema_offline_with_chunked_prefill_and_prefix_cache(llm: LLM) -> None:
    # max_num_batched_tokens=64 < the chat prompt: the prompt is prefilled in chunks (no
    # sampling, so no mask, until the last chunk); the repeated prompt hits the prefix cache.
    prompt = "Describe a person named Bob as JSON with a name and an age."
    schema = SCHEMAS[0][1]
    texts = _chat(llm, [prompt, prompt], _params(StructuredOutputsParams(json=schema)))  # type: ignore[arg-type]
    for text in texts:
        validate(json.loads(text), schema)
    assert texts[0] == texts[1]
    stats = llm.step_stats
    assert sum(s.prefix_cache_hits for s in stats) > 0


def test_choice_regex_grammar_offline(llm: LLM) -> None:
    texts = _chat(
        llm,
        ["Is the sky blue?", "What is your phone number?", "Say a greeting."],
        [
            _params(StructuredOutputsParams(choice=["yes", "no", "maybe"])),
            _params(StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), temperature=0.8, seed=3),
            _params(StructuredOutputsParams(grammar='start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{1,8}/')),
        ],
    )
    assert texts[0] in ("yes", "no", "maybe")
    assert len(texts[1]) == 8 and texts[1][3] == "-" and texts[1].replace("-", "").isdigit()
    first, _, name = texts[2].partition(" ")
    assert first in ("hello", "hi") and 1 <= len(name) <= 8 and name.isalpha() and name.islower()


def test_json_under_preemption(llm: LLM) -> None:
    """A KV cache of 12 blocks (192 tokens) for six ~60-token chats: requests are preempted
    and recomputed mid-generation; their grammar state survives (outputs are kept), and every
    output is still valid."""
    core = llm.engine_core
    core.reconfigure(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(enable_prefix_caching=False), num_blocks=12)
    try:
        llm.step_stats.clear()
        schemas = [s for _, s in SCHEMAS[:6]]
        texts = _chat(
            llm,
            [f"Reply with JSON for item {i}." for i in range(6)],
            [_params(StructuredOutputsParams(json=s)) for s in schemas],  # type: ignore[arg-type]
        )
        for text, schema in zip(texts, schemas, strict=True):
            validate(json.loads(text), schema)
        assert sum(s.num_preemptions for s in llm.step_stats) > 0
    finally:
        core.reconfigure(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(), num_blocks=64)


def test_compiling_grammar_does_not_hold_others_back(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one request's grammar is stuck compiling, an unconstrained request behind it
    runs to completion; the constrained one then runs once its grammar is ready."""
    core = llm.engine_core
    manager = core.structured_output
    release = threading.Event()
    original = manager.compiler

    def slow_compile(tokenizer: object, params: StructuredOutputsParams) -> object:
        assert release.wait(60), "test never released the compile"
        return original(tokenizer, params)  # type: ignore[arg-type]

    monkeypatch.setattr(manager, "compiler", slow_compile)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False, "title": "unique-for-this-test"}
    constrained = llm.processor.process("Give a number as JSON:", _params(StructuredOutputsParams(json=schema)))  # type: ignore[arg-type]
    plain = llm.processor.process("Hello", SamplingParams(max_tokens=4, temperature=0.0))
    core.add_request(fan_out("constrained", constrained)[0])
    core.add_request(fan_out("plain", plain)[0])
    finished: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {"constrained": [], "plain": []}
    while "plain" not in finished:
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = tokens[out.request_id]
    assert len(finished["plain"]) == 4 and "constrained" not in finished and not tokens["constrained"]
    assert manager.num_awaiting == 1
    release.set()
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    text = llm.tokenizer.decode(tokens["constrained"], skip_special_tokens=True)
    validate(json.loads(text), schema)


def test_a_compile_past_its_timeout_fails_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema whose compile never ends (a slow compiler injected through the compile seam)
    fails its request with an error naming the timeout, about `compile_timeout_s` after its
    compile began, while a constrained request sent with it completes; offline the stuck
    request's result is an error."""
    core = llm.engine_core
    manager = core.structured_output
    release = threading.Event()
    original = manager.compiler
    stuck = {"type": "object", "properties": {"x": {"type": "integer"}}, "title": "never-compiles"}

    def compiler(tokenizer: object, params: StructuredOutputsParams) -> object:
        if "never-compiles" in params.key[1]:
            assert release.wait(60), "test never released the compile"
        return original(tokenizer, params)  # type: ignore[arg-type]

    monkeypatch.setattr(manager, "compiler", compiler)
    monkeypatch.setattr(manager.cache, "timeout_s", 0.5)
    try:
        params = [_params(StructuredOutputsParams(json=stuck)),  # type: ignore[arg-type]
                  _params(StructuredOutputsParams(choice=["red", "green"]))]  # fmt: skip
        for rid, p in zip(("stuck", "fine"), params, strict=True):
            core.add_request(fan_out(rid, llm.processor.process("Pick a colour:", p))[0])
        errors: dict[str, str | None] = {}
        tokens: dict[str, list[int]] = {"stuck": [], "fine": []}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    errors[out.request_id] = out.error
        assert errors["stuck"] is not None and not tokens["stuck"]
        assert errors["stuck"].startswith("response_format: grammar compile timed out after 0.5 s"), errors
        assert errors["fine"] is None
        assert llm.tokenizer.decode(tokens["fine"], skip_special_tokens=True) in ("red", "green")
        outs = llm.generate(["Pick one:"], [params[0]], use_tqdm=False)  # the cached failure, offline
        assert outs[0].outputs[0].finish_reason == "error"
    finally:
        release.set()


def test_grammar_compiled_once_per_schema(llm: LLM) -> None:
    manager = llm.engine_core.structured_output
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
              "additionalProperties": False, "title": "compiled-once"}
    before = manager.num_compiles
    _chat(llm, ["JSON please.", "More JSON.", "Again."], _params(StructuredOutputsParams(json=schema)))  # type: ignore[arg-type]
    assert manager.num_compiles == before + 1


def test_async_scheduling_refuses_constrained_requests(llm: LLM) -> None:
    core = llm.engine_core
    core.reconfigure(SchedulerConfig(max_num_batched_tokens=64, async_scheduling=True), CacheConfig(), num_blocks=64)
    try:
        outs = llm.generate(["x", "y"], [_params(StructuredOutputsParams(choice=["a"])), SamplingParams(max_tokens=2)],
                            use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error"
        assert outs[1].outputs[0].finish_reason == "length"  # the unconstrained one runs
    finally:
        core.reconfigure(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(), num_blocks=64)
