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
