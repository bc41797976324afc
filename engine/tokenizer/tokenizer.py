"""The engine's tokenizer: a `tokenizers.Tokenizer` plus special tokens and a chat template.

Built from a GGUF file's vocabulary (byte-level BPE, as HF transformers builds it for
the same file, so both tokenize identically; a SentencePiece one by HF transformers itself), from a HF folder's `tokenizer.json`, or
as a byte-level fallback (one token per byte) for dummy models that ship none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.tokenizer.chat_template import CHATML_TEMPLATE, render_chat_template

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values whose split regex differs from GPT-2's (the ByteLevel default).
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Encode/decode, special tokens, chat template. Construct with a `from_*` method."""

    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None = None,
        name: str = "",
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        self.chat_template = chat_template
        self.name = name
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, tok in added.items() if tok.special)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """From `tokenizer.ggml.*` metadata (byte-level BPE "gpt2"; SentencePiece "llama" through HF).

        ValueError ("model: ...") for other tokenizer models.
        """
        from engine.model.arch import GGUFMetadata
        from engine.model.gguf_loader import open_gguf

        meta = GGUFMetadata(open_gguf(path))
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":  # SentencePiece (Gemma 3): HF transformers' own conversion of the same file
            return cls._from_gguf_sentencepiece(Path(path), meta)
        if kind != "gpt2":
            raise ValueError(f"model: GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2', "
                             f"SentencePiece 'llama')")
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or []
        merges = [_merge_pair(m) for m in meta.get("tokenizer.ggml.merges") or []]
        backend = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"),
                                  bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
        _add_typed_tokens(backend, tokens, types)
        bos = _token(tokens, meta.get("tokenizer.ggml.bos_token_id"))
        eos = _token(tokens, meta.get("tokenizer.ggml.eos_token_id"))
        _set_post_processor(backend, bos if meta.get("tokenizer.ggml.add_bos_token", False) else None,
                            eos if meta.get("tokenizer.ggml.add_eos_token", False) else None)
        return cls(backend, bos, eos, meta.get("tokenizer.chat_template"), name=Path(path).name)

    @classmethod
    def _from_gguf_sentencepiece(cls, path: Path, meta: Any) -> Tokenizer:
        """A SentencePiece vocabulary (`tokenizer.ggml.model` "llama": scores, byte fallback, "▁" for
        spaces) as HF transformers builds it from the same file: its tokens are then HF's by
        construction, which the oracle tests need. The conversion takes ~32 s for Gemma's 262,144
        tokens on a 2-core AMD EPYC, so its result is kept (`converted_tokenizer_path`) and later
        loads read that file (about a second)."""
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        bos = _token(tokens, meta.get("tokenizer.ggml.bos_token_id"))
        eos = _token(tokens, meta.get("tokenizer.ggml.eos_token_id"))
        return cls(_converted_sentencepiece(path), bos, eos, meta.get("tokenizer.chat_template"), name=path.name)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """From `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja` if present)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"model: {str(folder)!r} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(backend, _content(cfg.get("bos_token")), _content(cfg.get("eos_token")), template,
                   name=folder.name)

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """One token per UTF-8 byte (ids 0-255) + <|endoftext|>, <|im_start|>, <|im_end|> (256-258).

        For dummy models; ids beyond the vocabulary decode to nothing.
        """
        alphabet = byte_alphabet()
        tokens = [alphabet[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        backend = _byte_level_bpe(tokens, [], None, False)
        _add_typed_tokens(backend, tokens, [1] * 256 + [TOKEN_TYPE_CONTROL] * 3)
        return cls(backend, "<|endoftext|>", "<|im_end|>", CHATML_TEMPLATE, name="byte-level")

    # ---- API ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are always matched.

        `add_special_tokens` adds what the model's files ask for (e.g. BOS).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for a conversation (encode it with add_special_tokens=False)."""
        if not self.chat_template:
            raise ValueError(f"messages: tokenizer {self.name!r} has no chat template")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    self.bos_token, self.eos_token, **kwargs)

    def __len__(self) -> int:
        return self.vocab_size


def _byte_level_bpe(
    tokens: list[str], merges: list[tuple[str, str]], pre: str | None, add_prefix_space: bool
) -> BackendTokenizer:
    """A byte-level BPE backend; tokens not spelled in the byte alphabet are respelled."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab = {
        tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_typed_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Both are then matched whole in the text. A control token not spelled in the byte
    alphabet is a converter mislabel and is left alone (HF does the same).
    """
    letters = set(byte_alphabet().values())
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_CONTROL and set(tok) <= letters
    ]
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """Make `encode(add_special_tokens=True)` add BOS / EOS as the file asks."""
    if bos is None and eos is None:
        return
    pre = [bos] if bos else []
    post = [eos] if eos else []
    single = " ".join([f"{t}:0" for t in pre] + ["$A:0"] + [f"{t}:0" for t in post])
    pair = " ".join([single] + [f"{t}:1" for t in pre] + ["$B:1"] + [f"{t}:1" for t in post])
    specials = [(t, backend.token_to_id(t)) for t in {*pre, *post}]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _merge_pair(merge: str) -> tuple[str, str]:
    """GGUF stores a merge as "left right" (byte-level tokens never contain a space)."""
    left, _, right = merge.partition(" ")
    return left, right


def _token(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


TOKENIZER_CACHE = Path.home() / ".cache" / "servelab" / "tokenizers"


def converted_tokenizer_path(path: Path) -> Path:
    """Where the HF conversion of a GGUF's SentencePiece tokenizer is kept: named by the file's name,
    size and modification time and by the transformers version that converted it, so a changed file
    or another converter never reads a stale one."""
    import transformers

    st = path.resolve().stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return TOKENIZER_CACHE / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _converted_sentencepiece(path: Path) -> BackendTokenizer:
    """The `tokenizers` backend of HF's conversion of `path`'s tokenizer, from the kept file where
    there is one; a conversion that cannot be kept (a read-only home) is used all the same."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover (a dependency of the engine)
        raise ValueError("model: a SentencePiece GGUF tokenizer needs HF transformers") from e
    kept = converted_tokenizer_path(path)
    if kept.is_file():
        return BackendTokenizer.from_file(str(kept))
    backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
        backend.save(str(partial))
        os.replace(partial, kept)  # whole or absent: a reader never sees half a file
    except OSError as e:
        logger.warning("tokenizer: the conversion of %s could not be kept (%s); the next start converts it again",
                       path.name, e)
    return backend
