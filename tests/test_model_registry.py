"""The model registry (issue 58 item 1): the architecture a checkpoint names picks the model class;
an unsupported one is refused naming the supported list; settings the shared layer would not compute
are refused by name; the packaged shapes of the new families; layers with a family's switches never
reach the planned CPU forward; GGUF files of each family load as HF's checkpoint does."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.kernels.cpu_linear import prepack_linears
from engine.model import registry
from engine.model.arch import ModelArch
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model.loader import build_on_meta, load_model, resolve_model

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 256}  # fmt: skip


def _cfg(architecture: str, **extra: object) -> dict[str, object]:
    return {"architectures": [architecture], **TINY, **extra}


# ---- which class runs which architecture ---------------------------------------------
@pytest.mark.parametrize(("architecture", "family", "cls"), [
    ("LlamaForCausalLM", "llama", "LlamaForCausalLM"),
    ("MistralForCausalLM", "llama", "LlamaForCausalLM"),
    ("Qwen2ForCausalLM", "qwen2", "Qwen2ForCausalLM"),
    ("Qwen3ForCausalLM", "qwen3", "Qwen3ForCausalLM"),
    ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeForCausalLM"),
    ("Phi3ForCausalLM", "phi3", "Phi3ForCausalLM"),
])  # fmt: skip
def test_the_named_architecture_picks_the_class(architecture: str, family: str, cls: str) -> None:
    arch = ModelArch.from_hf_config(_cfg(architecture, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
                                    if family == "qwen3_moe" else _cfg(architecture))  # fmt: skip
    assert arch.family == family
    model_cls = registry.model_class(arch.family)
    assert model_cls.__name__ == cls and issubclass(model_cls, LlamaForCausalLM)
    assert (arch.qkv_bias, arch.qk_norm) == (family == "qwen2", family.startswith("qwen3"))


def test_a_shape_without_architectures_goes_by_model_type() -> None:
    assert ModelArch.from_hf_config({**TINY, "model_type": "qwen3"}).family == "qwen3"
    assert ModelArch.from_hf_config({**TINY, "model_type": "mixtral", "num_local_experts": 8,
                                     "num_experts_per_tok": 2}).family == "llama"  # fmt: skip
    assert ModelArch.from_hf_config(dict(TINY)).family == "llama"  # neither: the first shapes named none


def test_an_unsupported_hf_architecture_is_refused_naming_the_supported_list() -> None:
    with pytest.raises(ValueError, match="MambaForCausalLM") as info:
        ModelArch.from_hf_config(_cfg("MambaForCausalLM"))
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "qwen3moe",
                 "Gemma3ForCausalLM"):  # fmt: skip
        assert name in str(info.value)
    with pytest.raises(ValueError, match="'mamba' is not supported"):
        ModelArch.from_hf_config({**TINY, "model_type": "mamba"})


def test_an_unsupported_gguf_architecture_is_refused_naming_the_supported_list() -> None:
    reader = SimpleNamespace(metadata={"general.architecture": "mamba", "mamba.embedding_length": 640}, tensors=[])
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported") as info:
        ModelArch.from_gguf_metadata(reader)
    assert "llama, qwen2, qwen3, qwen3moe, phi3, gemma3" in str(info.value)


@pytest.mark.parametrize(("extra", "message"), [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
])  # fmt: skip
def test_settings_the_layer_would_not_compute_are_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(_cfg("Qwen3ForCausalLM", **extra))


def test_dense_layers_among_experts_are_refused() -> None:
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    for extra in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        with pytest.raises(ValueError, match="dense layers among the expert layers"):
            ModelArch.from_hf_config(_cfg("Qwen3MoeForCausalLM", **moe, **extra))


def test_qwen3_moe_renormalises_as_its_config_says() -> None:
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    assert ModelArch.from_hf_config(_cfg("Qwen3MoeForCausalLM", **moe)).norm_topk_prob is False  # HF's default
    arch = ModelArch.from_hf_config(_cfg("Qwen3MoeForCausalLM", norm_topk_prob=True, **moe))
    assert arch.norm_topk_prob is True and arch.intermediate_size == 48  # each expert's rows, not the dense MLP's
    mixtral = ModelArch.from_hf_config(_cfg("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2))
    assert mixtral.norm_topk_prob is True


# ---- the packaged shapes -----------------------------------------------------------------
@pytest.mark.parametrize(("name", "family", "billions", "context"), [
    ("qwen3-8b", "qwen3", 8.19, 40960),  # Qwen's model card: 8.2B
    ("qwen3-30b-a3b", "qwen3_moe", 30.53, 40960),  # 30.5B
    ("llama-3.1-8b", "llama", 8.03, 131072),  # 8.03B, 128k context
])  # fmt: skip
def test_packaged_shapes(name: str, family: str, billions: float, context: int) -> None:
    arch = resolve_model(ModelConfig(model=name))[0]
    assert arch.family == family and arch.max_position_embeddings == context
    assert arch.num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)
    with build_on_meta():  # the class the registry picks holds exactly the parameters the arch counts
        model = registry.model_class(arch.family)(arch, None)
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()


def test_qwen3_30b_a3b_shape_routes_8_of_128_experts() -> None:
    arch = resolve_model(ModelConfig(model="qwen3-30b-a3b"))[0]
    assert (arch.num_experts, arch.num_experts_per_tok, arch.intermediate_size) == (128, 8, 768)
    assert arch.qk_norm and arch.norm_topk_prob and arch.head_dim == 128


# ---- the planned CPU forward computes the plain Llama layer only ---------------------------
@pytest.mark.parametrize(("architecture", "plannable"), [
    ("LlamaForCausalLM", True), ("Phi3ForCausalLM", True), ("Qwen2ForCausalLM", False), ("Qwen3ForCausalLM", False),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_with_a_family_switch_never_reach_the_plan(architecture: str, plannable: bool, dtype: torch.dtype) -> None:
    from engine.attention.torch_backend import TorchAttentionBackend

    arch = ModelArch.from_hf_config(_cfg(architecture))
    model = registry.model_class(arch.family)(arch, TorchAttentionBackend()).to(dtype).eval()
    assert all(isinstance(layer, LlamaDecoderLayer) and layer.plannable == plannable for layer in model.model.layers)
    packed = prepack_linears(model)
    made = model.model.build_plan()
    if not plannable:
        assert not made and model.model.plan is None
        assert model.greedy_decode(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), [], None) is None  # type: ignore[arg-type]
    elif packed == 0:
        pytest.skip(f"oneDNN prepacking does not apply to {dtype} here: no plan for any model to compare against")
    else:
        from engine.kernels.cpu_kernels import kernels

        assert made == (kernels() is not None)  # the same layer, planned wherever the fused kernels are built


# ---- GGUF files of the new families ------------------------------------------------------
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
               "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp"}  # fmt: skip
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
_GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3"}


def _gguf_from_checkpoint(folder: Path, family: str, path: Path) -> None:
    """The HF checkpoint in `folder` as llama.cpp's converter writes a file of that family (float32,
    its tensor names, Q/K rows in HF's order, experts stacked [E, rows, cols])."""
    import gguf
    from safetensors.torch import load_file
    from test_arch_oracle import COMMON  # the tiny config the checkpoint was made from

    state = load_file(str(folder / "model.safetensors"))
    name = _GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), name)
    head_dim = {"qwen3": 32, "qwen3_moe": 16}.get(family, COMMON["hidden_size"] // COMMON["num_attention_heads"])
    ints = {"block_count": COMMON["num_hidden_layers"], "embedding_length": COMMON["hidden_size"],
            "feed_forward_length": COMMON["intermediate_size"], "attention.head_count": COMMON["num_attention_heads"],
            "attention.head_count_kv": COMMON["num_key_value_heads"], "context_length": COMMON["max_position_embeddings"],
            "attention.key_length": head_dim, "rope.dimension_count": head_dim}  # fmt: skip
    if family == "qwen3_moe":
        ints |= {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 48}
    for key, value in ints.items():
        w.add_uint32(f"{name}.{key}", value)
    w.add_float32(f"{name}.rope.freq_base", COMMON["rope_theta"])
    w.add_float32(f"{name}.attention.layer_norm_rms_epsilon", COMMON["rms_norm_eps"])
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, t in state.items():
        if hf_name in _GGUF_GLOBAL:
            tensors[_GGUF_GLOBAL[hf_name]] = t.numpy()
            continue
        parts = hf_name.split(".")
        layer, kind, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
        if kind.startswith("mlp.experts."):  # mlp.experts.E.gate_proj -> blk.N.ffn_gate_exps [E, I, H]
            stacked = f"blk.{layer}.{_GGUF_LAYER['mlp.' + parts[6]]}_exps.weight"
            experts.setdefault(stacked, {})[int(parts[5])] = t.numpy()
        else:
            tensors[f"blk.{layer}.{_GGUF_LAYER[kind]}.{suffix}"] = t.numpy()
    tensors |= {n: np.stack([by_e[e] for e in sorted(by_e)]) for n, by_e in experts.items()}
    for gguf_name, data in tensors.items():
        w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "phi3"])
def test_gguf_of_each_family_gives_hf_logits(family: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="HF transformers writes and runs the reference models")
    from test_arch_oracle import _write_checkpoint
    from test_llama_model import DenseReferenceBackend, run_prefill

    hf = _write_checkpoint(family, tmp_path / "hf")
    path = tmp_path / f"{family}.gguf"
    _gguf_from_checkpoint(tmp_path / "hf", family, path)
    ours = load_model(ModelConfig(model=str(path), dtype="float32"), DenseReferenceBackend(), "cpu")
    assert type(ours).__name__ == registry.family(family).class_name and ours.arch.family == family
    assert ours.gguf_path == path  # (the block kernels read only Q4_1 / Q8_0 blocks: none in this float32 file)
    ids = [1, 17, 99, 5, 42, 8, 127, 0, 64, 200, 3]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    got = run_prefill(ours, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
