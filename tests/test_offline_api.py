"""The offline API as a vLLM user writes it: `from engine import LLM, SamplingParams`, vLLM's prompt forms.

The model is SmolLM2's architecture with dummy weights and one layer (fast, deterministic
under greedy sampling); the tokenizer is the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.inputs import ParsedPrompt, TextPrompt, TokensPrompt, parse_prompts

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ARGS = {"model": "smollm2", "load_format": "dummy", "num_layers_override": 1, "num_blocks": 64}


def test_parse_prompts_accepts_vllm_forms_in_order() -> None:
    forms = [
        "a",
        {"prompt": "b"},
        {"prompt_token_ids": [1, 2]},
        TextPrompt(prompt="c", cache_salt="s"),
        TokensPrompt(prompt_token_ids=[3]),
        [4, 5],
    ]
    assert parse_prompts(forms) == [
        ParsedPrompt("a"), ParsedPrompt("b"), ParsedPrompt([1, 2]), ParsedPrompt("c", "s"), ParsedPrompt([3]),
        ParsedPrompt([4, 5]),
    ]  # fmt: skip
    assert parse_prompts("x") == [ParsedPrompt("x")]
    assert parse_prompts([7, 8]) == [ParsedPrompt([7, 8])]  # one prompt of token ids
    assert parse_prompts({"prompt_token_ids": [9]}) == [ParsedPrompt([9])]
    assert parse_prompts([]) == []


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ({"prompt": "a", "multi_modal_data": {}}, r"prompts: unsupported key\(s\) \['multi_modal_data'\]"),
        ([{"text": "a"}], r"prompts\[0\]: a prompt dict needs 'prompt'"),
        ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list"),
        ({"prompt": 3}, "'prompt' must be a string"),
        (["a", 3.5], r"prompts\[1\]: a prompt must be a string"),
        (b"bytes", "prompts: must be a string"),
        (42, "prompts: must be a string"),
    ],
)
def test_parse_prompts_rejects_what_it_cannot_run(prompts: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_prompts(prompts)


@pytest.fixture(scope="module")
def llm() -> Iterator[object]:
    from engine import LLM

    llm = LLM(**ENGINE_ARGS)
    yield llm
    llm.engine_core.shutdown()


def test_generate_gives_the_same_tokens_for_every_prompt_form(llm) -> None:  # noqa: ANN001
    from engine import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    forms = [text, {"prompt": text}, {"prompt_token_ids": ids}, ids]
    outs = llm.generate(forms, params, use_tqdm=False)
    assert [o.prompt for o in outs] == [text, text, None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len(tokens[0]) == 4 and all(t == tokens[0] for t in tokens)
    single = llm.generate({"prompt": text}, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == tokens[0]


def test_generate_n_fans_out_with_per_child_seeds(llm) -> None:  # noqa: ANN001
    from engine import SamplingParams

    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=11, ignore_eos=True)
    (out,) = llm.generate("Hello", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 3 for c in out.outputs)
    # Child i runs with seed + i: the same as n=1 with that seed.
    for i, c in enumerate(out.outputs):
        (alone,) = llm.generate("Hello", params.clone(n=1, seed=11 + i), use_tqdm=False)
        assert alone.outputs[0].token_ids == c.token_ids


def test_generate_reports_bad_prompts_before_running_anything(llm) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="unsupported key"):
        llm.generate([{"prompt": "ok"}, {"prompt": "x", "lora_request": None}], use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


VLLM_STYLE_SCRIPT = """
from engine import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    {{"prompt": "The capital of France is"}},
    {{"prompt_token_ids": [1, 2, 3, 4]}},
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=5, seed=0)

llm = LLM({engine_args})
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {{prompt!r}}, Generated text: {{generated_text!r}}, tokens: {{len(output.outputs[0].token_ids)}}")
"""


def test_a_vllm_style_offline_script_runs_end_to_end(tmp_path: Path) -> None:
    args = ", ".join(f"{k}={v!r}" for k, v in ENGINE_ARGS.items())
    script = tmp_path / "offline_inference.py"
    script.write_text(textwrap.dedent(VLLM_STYLE_SCRIPT.format(engine_args=args)))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Prompt: ")]
    assert len(lines) == 4
    assert lines[0].startswith("Prompt: 'Hello, my name is', Generated text: ")
    assert lines[2].startswith("Prompt: 'The capital of France is', ")
    assert lines[3].startswith("Prompt: None, ")
    assert all(0 < int(line.rsplit("tokens: ", 1)[1]) <= 5 for line in lines)
