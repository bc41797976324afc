"""The side-by-side benchmarks' own logic (no peer engine started, no timing asserted)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import offline_throughput as offline  # noqa: E402
import peers  # noqa: E402
import serving_throughput as serving  # noqa: E402


def test_cpu_flags_agree_with_cpuinfo() -> None:
    flags = peers.cpu_flags()
    assert set(flags) == set(peers.CPU_FLAGS) and all(isinstance(v, bool) for v in flags.values())
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        words = set(cpuinfo.read_text().split())
        assert all(flags[f] == (f in words) for f in peers.CPU_FLAGS)
    assert "avx512_bf16 " in peers.format_flags(flags)


def test_peer_paths_follow_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SERVELAB_PEERS_VENV", str(tmp_path / "venv"))
    monkeypatch.setenv("SERVELAB_PEERS_MODEL", str(tmp_path / "model"))
    peer = peers.peer_paths()
    assert peer.python == tmp_path / "venv" / "bin" / "python" and peer.model_dir == tmp_path / "model"
    assert not peers.peer_ready(peer)  # nothing there: ensure_peers would run scripts/peers.sh
    env = peer.env()
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "PYTHONPATH" not in env


def test_workload_w_prompt_lengths_are_seeded_and_in_range() -> None:
    lens = offline.prompt_lengths(64, 96, 160)
    assert lens == offline.prompt_lengths(64, 96, 160)
    assert len(lens) == 64 and min(lens) >= 96 and max(lens) <= 160 and len(set(lens)) > 10
    assert offline.prompt_lengths(3, 128, 128) == [128, 128, 128]


def test_flop_model_sums_per_prompt() -> None:
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model

    arch = resolve_model(ModelConfig())[0]
    one = offline.decode_flops(arch, [100], 4)
    assert offline.decode_flops(arch, [100, 100], 4) == pytest.approx(2 * one)
    assert offline.total_flops(arch, [100], 4) > one  # prefill tokens counted too


def test_unknown_engine_options_are_reported_not_fatal() -> None:
    args = argparse.Namespace(enforce_eager=False, async_scheduling=None)
    opts, notes = offline.servelab_options(args)
    if "enforce_eager" in offline.engine_option_names():
        assert opts == {"enforce_eager": False} and not notes
    else:
        assert opts == {} and len(notes) == 1 and "enforce_eager" in notes[0]
    assert offline.servelab_options(argparse.Namespace(enforce_eager=None, async_scheduling=None)) == ({}, [])


def test_serving_prompts_are_random_token_ids_shared_by_both_servers() -> None:
    a = serving.random_prompts(8, 128, 49152)
    assert a == serving.random_prompts(8, 128, 49152)
    assert all(len(p) == 128 and all(1000 <= t < 49152 for t in p) for p in a)
    specs = serving.specs_for(a, 16, "x")
    assert [s.prompt_token_ids for s in specs] == a and all(s.ignore_eos and s.max_tokens == 16 for s in specs)


def test_serving_args_turn_dtype_into_an_override() -> None:
    args = serving.parse_args(["--dtype", "bfloat16", "--concurrency", "16", "scheduler.max_num_seqs=32"])
    assert args.overrides == ["scheduler.max_num_seqs=32", "model.dtype=bfloat16"]
    assert args.concurrency == [16] and args.peer == "vllm"
    assert serving.parse_args(["--concurrency", "1,16"]).concurrency == [1, 16]
    with pytest.raises(SystemExit):
        serving.parse_args(["--concurrency", "0"])


def _summary(tok_s: float, ttft: float, tpot: float) -> dict:
    return {"completed": 4, "failed": 0, "output_throughput": tok_s, "median_ttft_ms": ttft,
            "median_tpot_ms": tpot, "median_itl_ms": tpot, "duration": 10.0, "total_output_tokens": 512}


def test_serving_report_gives_ratios_and_the_weight_read_bound(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model

    arch = resolve_model(ModelConfig())[0]
    args = serving.parse_args(["--concurrency", "1,16", "--dtype", "float32"])
    machine = {"cpu": "test CPU", "cpu_flags": peers.cpu_flags(), "cores": 2,
               "gemm_flops": {"float32": 2e11, "bfloat16": 8e11}, "memory_bandwidth": 1e10}
    results = [
        serving.Measured("servelab", 1, _summary(30.0, 50.0, 40.0), 0.1, 5.0),
        serving.Measured("servelab", 16, _summary(200.0, 800.0, 60.0), 0.1, 5.0),
        serving.Measured("servelab (vllm bench serve)", 16, {}, 0.0, 0.0,
                         {"repeat": 0, "vllm_bench": {"completed": 64, "output_throughput": 190.0,
                                                      "median_ttft_ms": 810.0, "median_tpot_ms": 61.0}}),
        serving.Measured("vllm-bfloat16", 1, _summary(40.0, 30.0, 25.0), 0.1, 5.0),
        serving.Measured("vllm-bfloat16", 16, _summary(400.0, 400.0, 30.0), 0.1, 5.0),
    ]
    res = serving.summarize_all(args, arch, machine, results)
    assert res["ratios_servelab_over_vllm"]["16"]["output_throughput"] == [pytest.approx(0.5)]
    assert res["ratios_servelab_over_vllm"]["16"]["median_ttft_ms"] == [pytest.approx(2.0)]
    # float32 weights at 10 GB/s: matmul params * 4 bytes / 1e10 per step
    assert res["batch1_weight_read_ms"] == pytest.approx(1000 * offline.matmul_params(arch) * 4 / 1e10)
    serving.report(res)
    out = capsys.readouterr().out
    assert "servelab / vLLM at c=16: output throughput 0.50" in out
    assert "vllm bench serve against servelab-serve, c=16: 190.0 out tok/s" in out
    assert "against the batch-1 weight-read time" in out


def test_offline_summary_takes_vllm_best_per_round(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model

    arch = resolve_model(ModelConfig())[0]
    args = offline.parse_args(["--num-requests", "4", "--output-len", "8", "--peer", "vllm"])
    R = offline.RunResult
    runs = {
        "servelab": [R("servelab", "float32", 1.0, 32), R("servelab", "float32", 2.0, 32)],
        "hf": [],
        "vllm-bfloat16": [R("vllm-bfloat16", "bfloat16", 0.5, 32), R("vllm-bfloat16", "bfloat16", 4.0, 32)],
        "vllm-float32": [R("vllm-float32", "float32", 2.0, 32), R("vllm-float32", "float32", 1.0, 32)],
    }
    res = offline.summarize(args, arch, {"float32": 2e11, "bfloat16": 8e11}, [100] * 4, runs, {})
    assert res["vllm_best_per_round"] == ["vllm-bfloat16", "vllm-float32"]
    assert res["ratios_vllm"] == [pytest.approx(0.5), pytest.approx(0.5)]
    offline.report(res)
    out = capsys.readouterr().out
    assert "servelab / vLLM-best: 0.50x" in out and "avx512_bf16" in out
