"""The hyper-parameters of a model of the families of engine/model/registry.py:
Llama / Mistral / Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3 (the Llama layer), Gemma 3 (its own
layer: sliding-window and global layers, `layer_types`); dense or a mixture of experts.

`ModelArch` is what the model, the worker (KV cache sizing) and the cost models read.
It is built from a Hugging Face `config.json` dict (also a model shape file,
`engine/model/shapes/<name>.yaml`) or from a GGUF file's metadata (llama.cpp key names); the
architecture either names picks the family (`family`) and its switches (`qkv_bias`, `qk_norm`,
`norm_topk_prob`). A config asking for what the shared layer does not compute (a partial rotary,
biases on every projection, dense layers among the experts) is refused by name: running it
anyway would give wrong outputs without a word.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigLimitError
from engine.model.registry import ModelFamily, family_of_gguf, family_of_hf
from engine.model.rope_scaling import RopeScaling

# GGUF readers are duck-typed: anything with `.metadata` (key -> Python value) and `.tensors`
# (engine/model/gguf_file.py's GGUFFile).
GGUFReaderLike = Any


@dataclass(frozen=True)
class ModelArch:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert for MoE models
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope_scaling: RopeScaling | None = None  # Llama-3.1's long-context frequency scaling
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    num_experts: int = 0  # 0: dense MLP
    num_experts_per_tok: int = 0
    name: str = "llama"
    family: str = "llama"  # engine/model/registry.py: which model class runs it
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary (Qwen3)
    norm_topk_prob: bool = True  # MoE: the top-k routing weights renormalised to sum to one
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    # Per layer "sliding_attention" (attends to the last `sliding_window` positions, itself included)
    # or "full_attention"; () for a model whose every layer attends to the whole context.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # the rotary base of the sliding layers (Gemma 3: 10,000)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) where set

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], name: str | None = None) -> ModelArch:
        """From a HF `config.json` dict (its `architectures`, else `model_type`, picks the family).

        Raises ValueError naming the first missing required field, an unsupported architecture
        (with the supported list) or a setting the family's layer does not compute.
        """
        fam = family_of_hf(cfg)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if cfg.get(key) is None:
                raise ValueError(f"model: config lacks {key!r}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        local_rope: Mapping[str, Any] = {}
        if "full_attention" in rope:  # transformers 5: one rotary per layer type (Gemma 3)
            rope, local_rope = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        _refuse_unsupported(cfg, rope, fam, num_experts)
        num_layers = int(cfg["num_hidden_layers"])
        sliding = _hf_sliding(cfg, fam, num_layers, local_rope)
        # Qwen3-MoE: `intermediate_size` is the dense MLP's (none here), `moe_intermediate_size` each expert's
        intermediate = cfg.get("moe_intermediate_size") if num_experts > 1 and fam.name == "qwen3_moe" else None
        return cls(
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(intermediate or cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-5),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            rope_scaling=RopeScaling.from_hf(cfg.get("rope_scaling") or rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.name == "gemma3")),  # HF Gemma's default: tied
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_id=_first_id(cfg.get("eos_token_id")),
            num_experts=num_experts if num_experts > 1 else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if num_experts > 1 else 0,
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "llama"),
            family=fam.name,
            qkv_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", fam.norm_topk_default)),
            hidden_act=fam.hidden_act,
            **sliding,
        )

    @classmethod
    def from_gguf_metadata(cls, reader: GGUFReaderLike) -> ModelArch:
        """From a GGUF file's metadata (a `GGUFFile`; keys `<arch>.block_count`, ...).

        Tied embeddings are inferred from the absence of an `output.weight` tensor.
        """
        meta = GGUFMetadata(reader)
        arch = meta.get("general.architecture", "llama")
        fam = family_of_gguf(arch)
        hidden = int(meta.require(f"{arch}.embedding_length"))
        heads = int(meta.require(f"{arch}.attention.head_count"))
        tensors = {t.name: t for t in getattr(reader, "tensors", [])}
        embd = tensors.get("token_embd.weight")
        vocab = (meta.get(f"{arch}.vocab_size") or meta.array_len("tokenizer.ggml.tokens")
                 or (int(embd.shape[-1]) if embd is not None else None))  # GGUF dims are fastest-first
        if vocab is None:
            raise ValueError("model: GGUF has neither a vocabulary size nor a token_embd tensor")
        head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
        num_experts = int(meta.get(f"{arch}.expert_count") or 0)
        ffn_key = f"{arch}.expert_feed_forward_length" if num_experts > 1 and fam.name == "qwen3_moe" else None
        rotary = meta.get(f"{arch}.rope.dimension_count")
        if rotary is not None and head_dim is not None and int(rotary) != int(head_dim):
            raise ValueError(f"model: a partial rotary ({rotary} of {head_dim} dimensions per head) is not supported")
        num_layers = int(meta.require(f"{arch}.block_count"))
        sliding = _gguf_sliding(meta, arch, fam, num_layers, hidden, heads, int(head_dim or hidden // heads))
        return cls(
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=int(head_dim or hidden // heads),
            intermediate_size=int(meta.require(ffn_key or f"{arch}.feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
            rope_scaling=_gguf_rope_scaling(meta, arch),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
            max_position_embeddings=int(meta.get(f"{arch}.context_length") or 4096),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            num_experts=num_experts if num_experts > 1 else 0,
            num_experts_per_tok=int(meta.get(f"{arch}.expert_used_count") or 0) if num_experts > 1 else 0,
            name=str(meta.get("general.name") or arch),
            family=fam.name,
            qkv_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm,
            # llama.cpp renormalises Qwen3-MoE's top-k weights (every released one asks for it)
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
            hidden_act=fam.hidden_act,
            **sliding,
        )

    def with_num_layers(self, num_layers: int | None) -> ModelArch:
        """A copy with at most `num_layers` layers (None: unchanged)."""
        if num_layers is None:
            return self
        if num_layers < 1:
            raise ValueError(f"num_layers_override: must be >= 1, got {num_layers}")
        return replace(self, num_layers=min(num_layers, self.num_layers))

    # ---- derived numbers ---------------------------------------------------------
    def max_model_len(self, requested: int | None, allow_long: bool = False) -> int:
        """The engine's context length: `requested` (ModelConfig.max_model_len; None: the model's
        own `max_position_embeddings`). The one rule every executor uses.

        A `requested` above the model's context raises ValueError naming both numbers, unless
        `allow_long` (ModelConfig.allow_long_max_model_len) says the caller wants it anyway: a
        ConfigLimitError (a ValueError) naming both numbers and the two settings.
        """
        own = self.max_position_embeddings
        if requested is None:
            return own
        if requested < 1:
            raise ValueError(f"model.max_model_len must be >= 1, got {requested}")
        if requested > own and not allow_long:
            raise ConfigLimitError(
                f"model.max_model_len={requested} is above the context of {self.name} ({own} tokens, its "
                f"max_position_embeddings); lower model.max_model_len, or set model.allow_long_max_model_len=true "
                f"to run past it (outputs past {own} tokens may be wrong)"
            )
        return requested

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (positions attended, the query's own included); None:
        the whole context."""
        if layer < len(self.layer_types) and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Stored parameters of `LlamaForCausalLM(self)`: every weight, norms included."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        mlp = 3 * h * self.intermediate_size
        if self.is_moe:
            mlp = self.num_experts * mlp + h * self.num_experts  # experts + router
        layer = attn + mlp + 2 * h  # + input and post-attention RMSNorm
        if self.family == "gemma3":
            layer += 2 * h  # + the pre- and post-feedforward RMSNorm (sandwich norms)
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * layer + embed + lm_head + h  # + final norm


def _refuse_unsupported(cfg: Mapping[str, Any], rope: Mapping[str, Any], fam: ModelFamily, num_experts: int) -> None:
    """ValueError naming a config setting the shared decoder layer would not compute."""
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"model: partial_rotary_factor={partial} is not supported (the rotary covers whole heads)")
    if cfg.get("attention_bias") and not fam.qkv_bias:
        raise ValueError("model: attention_bias=true (biases on every attention projection) is not supported")
    if fam.name != "gemma3" and "sliding_attention" in (cfg.get("layer_types") or ()):
        raise ValueError("model: sliding-window layers (layer_types) are supported for Gemma 3 only")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("model: attn_logit_softcapping is not supported (Gemma 2's; Gemma 3 has none)")
    if cfg.get("use_sliding_window"):
        raise ValueError("model: use_sliding_window=true is not supported (every layer attends to the whole context)")
    if cfg.get("mlp_bias"):
        raise ValueError("model: mlp_bias=true is not supported")
    if num_experts > 1 and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1):
        raise ValueError("model: dense layers among the expert layers (mlp_only_layers, decoder_sparse_step) "
                         "are not supported")
    hidden_act = cfg.get("hidden_activation") or cfg.get("hidden_act") or fam.hidden_act
    if hidden_act != fam.hidden_act:
        raise ValueError(f"model: hidden_act={hidden_act!r} is not supported (the {fam.name} MLP's is {fam.hidden_act})")


# Gemma 3: every sixth layer global when the checkpoint does not list the layer types
# (HF's `sliding_window_pattern` default; llama.cpp hard-codes it for `gemma3` files).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Layers sliding but every `pattern`-th (1-based), as HF's Gemma 3 config builds them."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


def _hf_sliding(cfg: Mapping[str, Any], fam: ModelFamily, num_layers: int,
                local_rope: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Gemma 3's layer types, window, local rotary base, attention scale and logit cap from a HF config
    (transformers 4's `sliding_window_pattern` / `rope_local_base_freq` or 5's `layer_types` /
    `rope_parameters.sliding_attention`); {} for another family."""
    if fam.name != "gemma3":
        return {}
    types = tuple(cfg.get("layer_types") or ()) or _layer_types(
        num_layers, int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or GEMMA3_SLIDING_PATTERN))
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"model: rope scaling of the sliding layers ({local_rope!r}) is not supported")
    cap = cfg.get("final_logit_softcapping")
    return {
        "layer_types": types[:num_layers],
        "sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        "rope_local_theta": float(cfg.get("rope_local_base_freq") or local_rope.get("rope_theta")
                                  or GEMMA3_LOCAL_ROPE_THETA),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),  # HF Gemma3TextConfig's default
        "final_logit_softcapping": float(cap) if cap else None,
    }


def _gguf_sliding(meta: GGUFMetadata, arch: str, fam: ModelFamily, num_layers: int, hidden: int, heads: int,
                  head_dim: int) -> dict[str, Any]:  # fmt: skip
    """The same from a GGUF file's metadata, with llama.cpp's defaults for what its `gemma3` files
    leave out: every sixth layer global, a local rotary base of 10,000, the attention scale
    head_dim ** -0.5 but for the 27B (62 layers: (hidden / heads) ** -0.5, llama.cpp's
    `f_attention_scale`); {} for another family."""
    if fam.name != "gemma3":
        return {}
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True where sliding
        types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    else:
        types = _layer_types(num_layers, int(pattern or GEMMA3_SLIDING_PATTERN))
    if meta.get(f"{arch}.attn_logit_softcapping"):
        raise ValueError("model: attn_logit_softcapping is not supported (Gemma 2's; Gemma 3 has none)")
    window, cap = meta.get(f"{arch}.attention.sliding_window"), meta.get(f"{arch}.final_logit_softcapping")
    return {
        "layer_types": types[:num_layers],
        "sliding_window": int(window) if window else None,
        "rope_local_theta": float(meta.get(f"{arch}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA),
        "query_pre_attn_scalar": float(hidden // heads if num_layers == 62 else head_dim),
        "final_logit_softcapping": float(cap) if cap else None,
    }


def _gguf_rope_scaling(meta: GGUFMetadata, arch: str) -> RopeScaling | None:
    """llama.cpp's `<arch>.rope.scaling.type` "linear" with its factor (Gemma 3 4B-27B); None otherwise."""
    if meta.get(f"{arch}.rope.scaling.type") == "linear" and float(meta.get(f"{arch}.rope.scaling.factor") or 1) != 1:
        return RopeScaling.from_hf({"rope_type": "linear", "factor": meta.get(f"{arch}.rope.scaling.factor")})
    return None


def _first_id(value: Any) -> int | None:
    """HF configs give a token id as an int, a list of ints, or null."""
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata (scalars, strings, arrays)."""

    def __init__(self, reader: GGUFReaderLike) -> None:
        self.fields: dict[str, Any] = reader.metadata

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"model: GGUF metadata lacks {key!r}")
        return value

    def array_len(self, key: str) -> int | None:
        value = self.fields.get(key)
        return None if value is None else len(value)
