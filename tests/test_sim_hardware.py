"""Hardware profiles, model shapes from configs, and KV capacity arithmetic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.model.arch import ModelArch
from engine.sim.hardware import HardwareProfile, measure_copy_gbs
from engine.sim.kv_capacity import activation_reserve_bytes, kv_bytes_per_token, kv_capacity
from engine.sim.model_counts import load_arch

LLAMA_70B = ModelArch(8192, 80, 64, 8, 128, 28672, 128256, max_position_embeddings=8192)


@pytest.mark.parametrize(
    ("name", "bf16", "bw", "mem", "link"),
    [("h100", 989.4, 3350, 80, 900), ("h200", 989.4, 4800, 141, 900), ("a100", 312, 2039, 80, 600)],
)
def test_datasheet_profiles(name: str, bf16: float, bw: float, mem: float, link: float) -> None:
    hw = HardwareProfile.load(name)
    assert (hw.name, hw.peak_tflops["bf16"], hw.mem_bandwidth_gbs, hw.memory_gb) == (name, bf16, bw, mem)
    assert hw.interconnect_bw_gbs == link
    assert hw.num_devices == 8
    assert hw.flops("bfloat16") == pytest.approx(bf16 * 1e12 * hw.gemm_efficiency)


def test_cpu_profile_loads_and_roundtrips(tmp_path) -> None:
    hw = HardwareProfile.load("cpu-2core")
    assert hw.peak_tflops["fp32"] > 0 and hw.mem_bandwidth_gbs > 0
    path = tmp_path / "cpu.yaml"
    hw.save(path, header="test")
    assert path.read_text().startswith("# test\n")
    assert HardwareProfile.load(str(path)) == hw
    tagged = HardwareProfile.from_dict({**hw.to_dict(), "extra": {"a": 1}, "vendor": "x"})
    assert tagged.extra == {"a": 1, "vendor": "x"}


def test_measurement_gives_a_positive_bandwidth() -> None:
    assert measure_copy_gbs(num_bytes=4 * 2**20, repeats=2) > 0.1


def test_unknown_hardware_and_dtype() -> None:
    with pytest.raises(FileNotFoundError):
        HardwareProfile.load("no-such-gpu")
    with pytest.raises(ValueError, match="fp8"):
        HardwareProfile.load("a100").flops("fp8")


def test_arch_from_hf_config_and_conf_names(tmp_path) -> None:
    hf = {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "m.yaml").write_text("arch:\n" + "".join(f"  {k}: {v}\n" for k, v in hf.items()))
    for path in (tmp_path / "config.json", tmp_path / "m.yaml"):
        arch = load_arch(str(path))
        assert arch.head_dim == 128 and arch.num_experts == 8 and arch.is_moe
        assert arch.num_parameters() == pytest.approx(46.7e9, rel=1e-3)  # Mixtral 8x7B


def test_known_model_sizes() -> None:
    assert LLAMA_70B.num_parameters() == pytest.approx(70.55e9, rel=1e-3)
    assert load_arch("llama-3-70b") == replace(LLAMA_70B, rope_theta=500000.0, bos_token_id=128000,
                                               eos_token_id=128001, name="llama-3-70b")  # fmt: skip
    assert load_arch("llama-3-8b").num_parameters() == pytest.approx(8.03e9, rel=1e-3)
    with pytest.raises(FileNotFoundError):
        load_arch("no-such-model")


def test_kv_bytes_per_token() -> None:
    # 2 (K, V) * 80 layers * 8 heads * 128 * 2 B = 327,680 B per token at tp=1.
    assert kv_bytes_per_token(LLAMA_70B, 1, "bf16") == 327_680
    assert kv_bytes_per_token(LLAMA_70B, 8, "bf16") == 40_960  # one KV head per rank
    assert kv_bytes_per_token(LLAMA_70B, 16, "fp8") == 20_480  # replicated head, 1 B


def test_kv_capacity_hand_computed() -> None:
    shape = ModelArch(8, 2, 4, 2, 2, 16, 32)  # 1704 params
    hw = HardwareProfile("toy", {"fp16": 1.0}, 1.0, memory_gb=1e-5, interconnect_bw_gbs=1.0, num_devices=2)
    # 10,000 B * 0.5 = 5000; weights 1704 * 2 B / 2 = 1704; reserve 296 -> 3000 B.
    # KV per token per rank: 2 * 2 layers * 1 head * 2 dim * 2 B = 16 B; block of 4 = 64 B -> 46 blocks.
    cap = kv_capacity(
        shape, hw, tp=2, dtype="fp16", block_size=4, gpu_memory_utilization=0.5, activation_reserve=296
    )
    assert (cap.num_blocks, cap.block_bytes, cap.weight_bytes, cap.available_bytes) == (46, 64, 1704, 3000)
    assert cap.max_tokens == 184
    with pytest.raises(ValueError, match="no room"):
        kv_capacity(shape, hw, tp=2, dtype="fp16", gpu_memory_utilization=0.1, activation_reserve=0)


def test_activation_reserve_formula() -> None:
    shape = ModelArch(8, 2, 4, 2, 2, 16, 32)
    # per token: (2*8 residual + (4+4)*2/1 qkv + 2*16 mlp) * 2 B = 128 B; logits 3 seqs * 32 * 4 B.
    assert activation_reserve_bytes(shape, 1, "fp16", 10, 3) == 10 * 128 + 384


def test_llama_70b_on_8_h200_fits_millions_of_tokens() -> None:
    cap = kv_capacity(LLAMA_70B, HardwareProfile.load("h200"), tp=8)
    assert 2.5e6 < cap.max_tokens < 2.8e6


def test_a_measured_cpu_profile_names_the_cpu_it_describes(tmp_path) -> None:
    """The packaged cpu-2core profile came from a CPU without bf16 units (bf16 0.0011 TFLOP/s) and
    was used on an AMX one (bf16 ~1.3 TFLOP/s), simulating bf16 steps ~1000x too slow. A measured
    profile records its CPU's GEMM flags; another CPU's flags are a mismatch, datasheets never."""
    from engine.sim.hardware import GEMM_CPU_FLAGS

    hw = HardwareProfile.load("cpu-2core")
    assert hw.cpu_isa and set(hw.cpu_isa) <= set(GEMM_CPU_FLAGS)
    here = frozenset({"fpu", *hw.cpu_isa})
    assert hw.host_mismatch(here) is None
    why = hw.host_mismatch(here - {"amx_bf16"})
    assert why is not None and "cpu-2core" in why and "measure_cpu_profile" in why
    assert hw.host_mismatch(frozenset()) is None  # flags unreadable: nothing to compare
    assert HardwareProfile.load("h200").host_mismatch(frozenset({"avx2"})) is None
    hw.save(tmp_path / "cpu.yaml")
    assert HardwareProfile.load(str(tmp_path / "cpu.yaml")).cpu_isa == hw.cpu_isa


def test_measure_cpu_profile_records_the_flags(monkeypatch) -> None:
    import engine.kernels.isa
    import engine.sim.hardware as hardware

    monkeypatch.setattr(hardware, "measure_gemm_tflops", lambda dtype, n: {"fp32": 0.1}.get(dtype, 1.0))
    monkeypatch.setattr(hardware, "measure_copy_gbs", lambda: 10.0)
    monkeypatch.setattr(engine.kernels.isa, "cpu_flags", lambda: frozenset({"fpu", "avx2", "amx_bf16"}))
    hw = hardware.measure_cpu_profile(rounds=1, memory_gb=8)
    assert hw.cpu_isa == ["avx2", "amx_bf16"] and hw.peak_tflops == {"fp32": 0.1, "bf16": 1.0, "fp16": 1.0}


def test_roofline_warns_once_on_a_profile_of_another_cpu(monkeypatch, caplog) -> None:
    import engine.sim.executor as executor

    hw = replace(HardwareProfile.load("cpu-2core"), cpu_isa=["no_such_flag"])
    monkeypatch.setattr(executor, "_warned", set())
    arch = load_arch("smollm2")
    with caplog.at_level("WARNING", logger="engine.sim.executor"):
        executor.build_step_model("roofline", arch, hw)
        executor.build_step_model("roofline", arch, hw)
    assert [r.getMessage() for r in caplog.records if "re-measure" in r.getMessage()] == [hw.host_mismatch()]
