"""Tokenization: the engine's `Tokenizer`, chat templates, incremental detokenization."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "get_tokenizer"]


def get_tokenizer(model_config: ModelConfig) -> Tokenizer:
    """The tokenizer that goes with `model_config.model` (see engine/model/loader.py).

    GGUF -> its embedded vocabulary; HF folder -> its tokenizer.json (byte-level
    fallback if it has none); a model shape (dummy weights) -> byte-level fallback.
    """
    from engine.model.loader import resolve_source

    source = resolve_source(model_config.model)
    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    if source.kind == "hf" and (source.path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_folder(source.path)
    return Tokenizer.byte_level()
