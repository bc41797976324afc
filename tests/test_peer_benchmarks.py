"""The side-by-side benchmarks' own logic (no peer engine started, no timing asserted)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import offline_throughput as offline  # noqa: E402
import peers  # noqa: E402
import serving_sides  # noqa: E402
import serving_throughput as serving  # noqa: E402
import side_by_side as sbs  # noqa: E402


def test_cpu_flags_agree_with_cpuinfo() -> None:
    flags = peers.cpu_flags()
    assert set(flags) == set(peers.CPU_FLAGS) and all(isinstance(v, bool) for v in flags.values())
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        words = set(cpuinfo.read_text().split())
        assert all(flags[f] == (f in words) for f in peers.CPU_FLAGS)
    assert "avx512_bf16 " in peers.format_flags(flags)


def test_read_rates_are_measured_at_each_steps_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A floor's rate is measured on a buffer of the step's own size (a cache may hold it), with
    the rate beyond every cache beside it; `rate_at` answers for the nearest size measured."""
    llc = peers.last_level_cache_bytes()
    assert llc is None or llc > 0
    assert peers.beyond_cache_bytes() >= max(2**30, 2 * (llc or 0))
    sizes: list[int] = []
    monkeypatch.setattr(peers, "read_bandwidth", lambda n, min_s=0.5: sizes.append(int(n)) or 1e9 * n / 2**20)
    rates = peers.read_rates([2**20, 4 * 2**20, 2**20, None])
    assert sorted(sizes) == [2**20, 4 * 2**20, peers.beyond_cache_bytes()]  # each size once, beyond the caches last
    assert rates["memory"] == {"bytes": peers.beyond_cache_bytes(), "rate": 1e9 * peers.beyond_cache_bytes() / 2**20}
    assert peers.rate_at(rates, 1.2 * 2**20) == pytest.approx(1e9) and peers.rate_at(rates, 3.5 * 2**20) == pytest.approx(4e9)


def test_read_bandwidth_reads_a_buffer_of_the_size_asked() -> None:
    rate = peers.read_bandwidth(2**20, min_s=0.02)
    # bytes per second of some real read, not 0 or inf; the floor is loose because a 2-core machine shared with
    # compiles measured 94 MB/s once (a sanity bound, not a speed target)
    assert 1e6 < rate < 1e13


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
    text = serving.specs_for(a[:2], 16, "x", as_text=True)  # llama.cpp takes text: both sides get the same text
    assert all(s.prompt_token_ids is None and s.prompt and s.prompt_len == 128 for s in text)


def test_no_server_is_sent_a_prompt_twice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A repeated prompt is a prefix-cache hit on one side only (16-token blocks hit 112 of 128
    # tokens, vLLM-CPU's 128-token blocks none): warm-up, clients and sampling passes each draw
    # their own prompts, and both servers (and every round) get the same ones.
    sent: dict[str, list[tuple[int, ...]]] = {}
    bench_seeds: dict[str, list[int]] = {}

    class FakeServer:
        start_s, url, proc = 0.0, "http://127.0.0.1:1", None

        def __init__(self, name: str) -> None:
            self.name, self.log_path = name, tmp_path / f"{name}.log"
            self.log_path.write_text("")

        def start(self) -> None: ...

        def stop(self) -> None: ...

    def fake_drive(server: FakeServer, specs: list, concurrency: int, sampling: str) -> dict:
        sent.setdefault(server.name, []).extend(tuple(s.prompt_token_ids) for s in specs)
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0,
                "work": serving_sides.work_counts(len(specs), len(specs), 4.0 * len(specs), None)}

    def fake_bench(peer, server, args, concurrency, sampling, tmp, tag, seed):  # type: ignore[no-untyped-def]
        bench_seeds.setdefault(server.name, []).append(seed)
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0, "median_itl_ms": 1.0}

    monkeypatch.setattr(serving_sides, "drive", fake_drive)
    monkeypatch.setattr(serving_sides, "vllm_bench_serve", fake_bench)
    monkeypatch.setattr(serving_sides, "peer_paths", lambda: None)
    args = argparse.Namespace(sampling=["greedy", "temperature1"], concurrency=[1, 16], num_requests=8,
                              num_requests_c1=3, output_len=4, peer="vllm")  # fmt: skip

    def prompts(seed: int, n: int) -> list[list[int]]:
        return serving.random_prompts(n, 32, 49152, seed)

    for name in ("servelab", "vllm"):
        serving_sides.run_round(FakeServer(name), name, "equal settings", 0, prompts, args, bench=True)  # type: ignore[arg-type]
    for name, got in sent.items():
        assert len(got) == 2 * (1 + 3 + 16 + 8) and len(set(got)) == len(got), name  # warm-ups + measurements
    assert sent["servelab"] == sent["vllm"]
    assert bench_seeds["servelab"] == bench_seeds["vllm"] and len(set(bench_seeds["vllm"])) == 4
    workbench_seeds = {s for m in range(4) for s in serving_sides.measurement_seeds(m)[:2]}
    assert not workbench_seeds & set(bench_seeds["vllm"])


def test_serving_args_give_both_servers_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    probes = []
    monkeypatch.setattr(serving, "pinned_float32_linear", lambda: probes.append(1) or "plain")
    args = serving.parse_args(["--concurrency", "16", "--max-num-seqs", "8", "scheduler.foo=1"])
    assert args.overrides == ["scheduler.foo=1"] and args.concurrency == [16] and args.peer == "vllm"
    assert args.repeats == 3 and args.sampling == ["greedy", "temperature1"]
    (label, settings), = serving.configurations(args)
    assert label == "equal settings" and settings == sbs.Settings(512, 8, 2048, "bfloat16", "plain")
    vllm = sbs.Settings(512, 8, 2048).vllm_args()
    ours = settings.servelab_overrides()
    # the float32 kernel probed once by the harness and pinned for every round's servelab server
    assert "kernels.float32_linear=plain" in ours and probes == [1]
    given = serving.parse_args(["--float32-linear", "prepacked", "--peer", "llamacpp"])
    (_, pinned), = serving.configurations(given)
    assert pinned is not None and pinned.float32_linear == "prepacked" and pinned.dtype == "auto" and probes == [1]
    assert vllm[vllm.index("--max-num-batched-tokens") + 1] == "512" and "scheduler.max_num_batched_tokens=512" in ours
    assert vllm[vllm.index("--max-num-seqs") + 1] == "8" and "scheduler.max_num_seqs=8" in ours
    assert vllm[vllm.index("--max-model-len") + 1] == "2048" and "model.max_model_len=2048" in ours
    both = serving.parse_args(["--own-defaults"])
    assert [c[0] for c in serving.configurations(both)] == ["equal settings", "own defaults"]
    with pytest.raises(SystemExit):
        serving.parse_args(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        serving.parse_args(["--sampling", "nucleus"])


def test_servelab_runs_the_peers_weights(tmp_path: Path) -> None:
    args = serving.parse_args(["--peer", "vllm"])
    server = serving.make_server("servelab", "vllm", serving.configurations(args)[0][1], args, tmp_path, "t")
    assert "model.quantized_decode=false" in server.cmd  # vLLM multiplies bfloat16 weights
    server = serving.make_server("servelab", "llamacpp", None, args, tmp_path, "t")
    assert "model.quantized_decode=true" in server.cmd and not any("scheduler." in a for a in server.cmd)


def test_abba_order_and_spreads() -> None:
    assert sbs.abba_order(4, "a", "b") == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert sbs.spread([3.0, 1.0, None, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "cv": 0.5}
    assert sbs.spread([4.0])["cv"] is None and sbs.format_cv(sbs.spread([4.0])) == "n/a"
    assert sbs.format_cv(sbs.spread([9.0, 11.0])) == f"CV {100 * 2**0.5 / 10:.1f}%"  # stdev sqrt(2) over mean 10
    assert sbs.format_spread(sbs.spread([3.0, 1.0, 2.0])) == "2.0 (1.0-3.0)"
    assert sbs.ratio_spread([2.0, 4.0], [1.0, 0.0])["median"] == 2.0  # a zero denominator is no ratio


def test_step_read_floors_count_the_bytes_each_side_reads() -> None:
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model
    from engine.model.source import embedded_gguf_path

    arch = resolve_model(ModelConfig())[0]
    params = offline.matmul_params(arch)
    assert sbs.step_read_bytes("vllm", params, None)["bytes"] == 2 * params
    # a float32 run reads 4 bytes a weight on both dense sides (the 2026-12-07 vLLM run's floor said bfloat16)
    dense = sbs.step_read_bytes("servelab-dense", params, None, dense_dtype="float32")
    assert dense["bytes"] == 4 * params and dense["what"].startswith("float32")
    assert sbs.step_read_bytes("vllm", params, None, dense_dtype="float32")["bytes"] == 4 * params
    blocks = sbs.step_read_bytes("llamacpp", params, embedded_gguf_path())["bytes"]
    # Q4_1 layers (20 bytes per 32 weights) and the Q8_0 tied head (34 per 32): about a third of bfloat16
    assert 0.3 * 2 * params < blocks < 0.4 * 2 * params
    assert sbs.step_read_bytes("servelab-blocks", params, None, 96.4e6)["bytes"] == 96.4e6
    # keys and values: 128-token prompts, 4 output tokens: the TPOT's steps attend 129, 130, 131 positions
    per_position = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    kv = sbs.kv_read_bytes(arch.num_layers, arch.num_kv_heads, arch.head_dim, 128, 4)
    assert kv == per_position * (129 + 130 + 131) / 3 == 30 * 2 * 3 * 64 * 2 * 130


def _m(server: str, rnd: int, tok_s: float, ttft: float, tpot: float, conc: int = 16,
       client: str = "workbench") -> serving_sides.Measured:
    fig = {"output_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "median_itl_ms": tpot}
    return serving_sides.Measured(server, "equal settings", "greedy", conc, client, rnd, fig)


def test_serving_report_gives_medians_ranges_ratios_and_floors(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model

    arch = resolve_model(ModelConfig())[0]
    args = serving.parse_args(["--concurrency", "1,16", "--sampling", "greedy"])
    machine = {"cpu": "test CPU", "cpu_flags": peers.cpu_flags(), "cores": 2,
               "read_rates": {"at": {"96400000": 1e10}, "memory": {"bytes": 2**30, "rate": 5e9}},
               "gemm_reference": {"what": "torch.mm at batch 16 on the model's shapes", "bfloat16_flops": 8e11}}
    results = [_m("servelab", r, 200.0 + 10 * r, 800.0, 60.0) for r in range(3)]
    results += [_m("vllm", r, 100.0, 400.0 + 100 * r, 30.0) for r in range(3)]
    results += [_m("servelab", r, 30.0, 50.0, 40.0, conc=1) for r in range(3)]
    results += [_m("vllm", r, 40.0, 30.0, 25.0, conc=1) for r in range(3)]
    res = serving.summarize_all(args, arch, machine, results)
    c16 = next(t for t in res["tables"] if t["concurrency"] == 16)
    assert c16["servers"]["servelab"]["output_throughput"] == {"median": 210.0, "min": 200.0, "max": 220.0, "n": 3,
                                                                "cv": pytest.approx(10 / 210)}
    assert c16["ratio_servelab_over_peer"]["output_throughput"]["median"] == pytest.approx(2.1)
    assert c16["ratio_servelab_over_peer"]["median_ttft_ms"]["min"] == pytest.approx(800 / 600)
    floor = res["step_read_floors"]["vllm"]
    assert floor["bytes"] == 2 * offline.matmul_params(arch)  # vLLM and servelab both read bfloat16 here
    assert floor["floor_ms"] == pytest.approx(1000 * 2 * offline.matmul_params(arch) / 1e10)
    assert floor["memory_floor_ms"] == pytest.approx(2 * floor["floor_ms"])  # beyond the caches at half the rate
    serving.report(res)
    out = capsys.readouterr().out
    assert "210.0 (200.0-220.0)" in out and "2.10 (2.00-2.20)" in out and "ABBA" in out
    assert "CV 4.8%" in out  # the servelab rounds' throughput: stdev 10 over mean 210
    assert "torch.mm at batch 16" in out and "avx512_bf16" in out and "max_num_batched_tokens=512" in out
    assert "the DRAM-rate floor" in out and "bfloat16 matmul weights" in out and "the cache-rate floor" in out
    assert "machine-independent bar" in out


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


def test_c1_inprocess_figures_and_floors(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/c1_inprocess.py: TPOT over the tokens after the first, per-round medians, the
    same-round ratio and the floor multiple from the bytes each side reads."""
    import c1_inprocess as c1

    assert c1.tpot_s([0.5]) is None and c1.tpot_s([0.1, 0.2, 0.4]) == pytest.approx(0.15)
    fig = c1.round_figures({"requests": [{"ttft_s": 0.05, "token_times": [0.05, 0.06, 0.07]},
                                         {"ttft_s": 0.07, "token_times": [0.07, 0.09, 0.11]}]})  # fmt: skip
    assert fig["tpot_ms"] == pytest.approx(15.0) and fig["ttft_ms"] == pytest.approx(60.0)
    rounds = [{"round": 0, "side": "servelab", "tpot_ms": 8.0, "ttft_ms": 40.0},
              {"round": 0, "side": "llamacpp", "tpot_ms": 10.0, "ttft_ms": 50.0},
              {"round": 1, "side": "llamacpp", "tpot_ms": 12.0, "ttft_ms": 60.0},
              {"round": 1, "side": "servelab", "tpot_ms": 9.0, "ttft_ms": 45.0}]  # fmt: skip
    step_bytes = {"servelab": 96e6, "llamacpp": 100e6}
    # the rate at each side's bytes, measured before (llama.cpp's bytes only) and after the rounds
    before = {"at": {"100000000": 26e9}, "memory": {"bytes": 2**30, "rate": 12e9}, "llc_bytes": 2**29}
    after = {"at": {"96000000": 24e9, "100000000": 24e9}, "memory": {"bytes": 2**30, "rate": 12e9}, "llc_bytes": 2**29}
    rates = c1.floor_rates(step_bytes, before, after)
    assert rates == {"memory": 12e9, "servelab": 24e9, "llamacpp": 25e9}
    s = c1.summarize(rounds, step_bytes, rates, 2)
    assert s["sides"]["servelab"]["floor_ms"] == pytest.approx(4.0)
    assert s["sides"]["servelab"]["tpot_over_floor"]["median"] == pytest.approx(2.125)
    assert s["sides"]["servelab"]["memory_floor_ms"] == pytest.approx(8.0)
    assert s["sides"]["llamacpp"]["floor_ms"] == pytest.approx(4.0)
    assert "512 MiB" in c1.rates_line(before, after, 2)
    assert s["sides"]["servelab"]["slow_rounds"] == []  # two rounds: no median to be off
    cond = {"busy": [], "runnable_mean": 2.0, "steal": 0.0, "cores": 2, "step_read_rate": 50e9}
    slow_rounds = [{"round": k, "side": "servelab", "tpot_ms": t, "ttft_ms": 40.0,
                    "conditions": {**cond, "step_read_rate": 30e9 if t > 9 else 50e9}}
                   for k, t in enumerate((8.0, 8.1, 11.0))]  # fmt: skip
    slow_rounds += [{"round": k, "side": "llamacpp", "tpot_ms": 10.0, "ttft_ms": 50.0, "conditions": cond}
                    for k in range(3)]  # fmt: skip
    s3 = c1.summarize(slow_rounds, step_bytes, rates, 3)
    text = "\n".join(c1.format_summary(s3))
    assert "slow round: servelab round 3 (TPOT p50 +35.8% against the median): the step's bytes read at 30.0 GB/s" in text
    assert s["ratio"]["tpot_ms"]["min"] == pytest.approx(0.75) and s["ratio"]["tpot_ms"]["max"] == pytest.approx(0.8)
    line = c1.step_bytes_line({"llamacpp": 96.4e6, "servelab": None}, 4.42e6, 128, 128)
    assert line == ("a step reads: llamacpp 96.4 MB of matrices, servelab matrices unknown; + 4.42 MB of keys and "
                    "values each (the mean step of a TPOT attends 192 positions; 16-bit on both sides)")
    text = "\n".join(c1.format_summary(s))
    assert "96.0 MB" in text and "servelab / llama-cpp-python, same round: TPOT 0.78 (0.75-0.80)x, TTFT" in text
    assert "DRAM floor" in text and "cache floor" in text
    # llama-bench beside it: TPOT only (no TTFT), its ratio to servelab in the same round
    bench_rounds = rounds + [{"round": k, "side": "llama-bench", "tpot_ms": 11.0, "ttft_ms": None} for k in range(2)]
    s2 = c1.summarize(bench_rounds, step_bytes | {"llama-bench": 100e6}, rates | {"llama-bench": 25e9}, 2)
    assert s2["ratios"]["llama-bench"]["tpot_ms"]["median"] == pytest.approx((8 / 11 + 9 / 11) / 2)
    assert s2["sides"]["llama-bench"]["memory_floor_ms"] == pytest.approx(100e6 / 12e9 * 1e3)
    text = "\n".join(c1.format_summary(s2))
    assert "servelab / llama-bench, same round: TPOT 0.77 (0.73-0.82)x" in text and "llama-bench TTFT" not in text


def test_c1_inprocess_servelab_worker_reads_the_blocks() -> None:
    """The servelab side in a process of its own, as a round runs it: every prompt's token times
    after its warm-up, and the bytes its batch-1 step reads from its start-up packs."""
    import json
    import subprocess

    job = {"threads": 1, "prompts": [[1000 + i for i in range(8)], [2000 + i for i in range(8)]], "output_len": 4,
           "warmup": 1}  # fmt: skip
    proc = subprocess.run([sys.executable, str(Path(serving.__file__).with_name("c1_inprocess.py")), "--worker"],
                          input=json.dumps(job), capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res["requests"]) == 1 and len(res["requests"][0]["token_times"]) == 4
    times = res["requests"][0]["token_times"]
    assert res["requests"][0]["ttft_s"] == times[0] and times == sorted(times)
    if res["step_bytes"] is not None:  # a CPU whose decode kernels read the GGUF's blocks
        assert 50e6 < res["step_bytes"] < 150e6


# ---- the peers as their maintainers run them (issue 55) -----------------------------------------
def test_vllm_is_served_bound_to_its_cores_with_one_kept_for_the_api_server(tmp_path: Path) -> None:
    """vLLM's CPU docs: OpenMP bound to cores of its own, 1-2 cores for the serving framework."""
    assert peers.vllm_cpu_binding([0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert peers.vllm_cpu_binding([3]) == {"VLLM_CPU_OMP_THREADS_BIND": "3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert peers.vllm_cpu_binding(list(range(32)))["VLLM_CPU_OMP_THREADS_BIND"] == "0-29"
    assert peers.vllm_cpu_binding([0, 1, 2, 5, 6, 9])["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5-6"
    peer = peers.Peer(tmp_path / "venv", tmp_path / "model")
    env = peer.serving_env(cores=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    server = serving_sides.vllm_server(tmp_path, peer, [], "t")
    assert server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == ("1" if len(os.sched_getaffinity(0)) > 1 else "0")
    # --vllm-reserved-cpus: 0 binds OpenMP to every core; never all cores reserved
    assert peers.vllm_cpu_binding([0, 1], reserved=0) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
    assert peers.vllm_cpu_binding([0, 1], reserved=5)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    server = serving_sides.vllm_server(tmp_path, peer, [], "t", reserved=0)
    assert server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_serving_throughput_reads_the_same_gguf_model_on_both_sides(tmp_path: Path) -> None:
    """--model gemma3-270m: servelab gets model.model, llama-server the same GGUF; vLLM's side has smollm2 only.
    servelab serves it under the name the clients ask every side for (its own name answered 404 to them)."""
    args = serving.parse_args(["--peer", "llamacpp", "--model", "gemma3-270m", "scheduler.x=1"])
    assert args.overrides == ["model.model=gemma3-270m", "scheduler.x=1"]
    server = serving.make_server("servelab", "llamacpp", None, args, tmp_path, "t")
    assert f"server.served_model_name={serving_sides.MODEL_NAME}" in server.cmd and "model.model=gemma3-270m" in server.cmd
    # the report names the block types the file stores, not SmolLM2's
    assert serving.weights_label("llamacpp", "gemma3-270m").endswith("(gemma3-270m: Q4_K / Q5_0 / Q6_K / Q8_0)")
    assert serving.weights_label("llamacpp", "smollm2").endswith("(smollm2: Q4_1 / Q8_0)")
    assert serving_sides.model_gguf("smollm2").name.endswith(".gguf")
    with pytest.raises(SystemExit):
        serving.parse_args(["--peer", "vllm", "--model", "gemma3-270m"])
    with pytest.raises(SystemExit, match="not a packaged GGUF model"):
        serving_sides.model_gguf("llama-3-8b")


def test_llama_server_gets_a_slot_per_request_and_the_same_context_per_slot(tmp_path: Path) -> None:
    bins = peers.LlamaCppBinaries(tmp_path)
    cmd = serving_sides.llama_server_command(bins, Path("m.gguf"), 8080, 16, 2048, 512, 2)
    arg = {a: cmd[i + 1] for i, a in enumerate(cmd[:-1])}
    assert cmd[0] == str(tmp_path / "llama-server") and arg["-m"] == "m.gguf"
    assert arg["-np"] == "16" and "-cb" in cmd and arg["-c"] == str(16 * 2048) and "--no-kv-unified" in cmd
    assert arg["-t"] == arg["-tb"] == "2" and arg["-b"] == arg["-ub"] == "512" and "--metrics" in cmd
    own = serving_sides.llama_server_command(bins, Path("m.gguf"), 8080, 4, None, None, 2)
    assert "-c" not in own and "-b" not in own and own[own.index("-np") + 1] == "4"
    assert bins.env()["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(tmp_path)  # the libraries sit beside them
    # each concurrency gets its own pair of fresh servers with that many slots
    args = serving.parse_args(["--peer", "llamacpp", "--concurrency", "1,16"])
    assert serving.concurrency_groups(args) == [[1], [16]]
    assert serving.concurrency_groups(serving.parse_args(["--concurrency", "1,16"])) == [[1, 16]]
    py = serving.parse_args(["--peer", "llamacpp-python"])
    assert serving.make_server("servelab", "llamacpp-python", None, py, tmp_path, "t").cmd.count(
        "model.quantized_decode=true") == 1


def test_a_missing_llama_cpp_build_names_make_peers_llamacpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVELAB_LLAMACPP_BIN", str(tmp_path))
    why = peers.llamacpp_missing()
    assert why is not None and "make peers-llamacpp" in why and "llama-server" in why
    with pytest.raises(SystemExit, match="make peers-llamacpp"):
        serving_sides.llama_server(tmp_path, 1, 2048, 512, "t")
    for name in ("llama-server", "llama-bench"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "BUILD_INFO.json").write_text('{"llama_cpp_python": "0.3.36", "llama_cpp_commit": "0c1e57098bba", '
                                              '"cmake_flags": "-DGGML_NATIVE=ON", "amx": "absent", "fallback": "none"}')
    assert peers.llamacpp_missing() is None
    assert peers.llamacpp_binaries().describe() == ("llama.cpp 0c1e57098b (vendored by llama-cpp-python 0.3.36), "
                                                    "-DGGML_NATIVE=ON, AMX absent")


def test_llama_bench_runs_tg_at_the_measured_depth() -> None:
    import c1_inprocess as c1

    bins = peers.LlamaCppBinaries(Path("/b"))
    cmd = c1.llama_bench_command(bins, Path("m.gguf"), 128, 128, 2, 3)
    assert cmd == ["/b/llama-bench", "-m", "m.gguf", "-p", "0", "-n", "128", "-d", "128", "-t", "2", "-r", "3",
                   "-o", "json"]
    out = ('load: noise before the JSON\n[{"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 128, "n_depth": 128, '
           '"n_threads": 2, "avg_ts": 80.0, "stddev_ts": 1.5, "cpu_info": "AMD EPYC"}]')
    fig = c1.llama_bench_figures(out, 128)
    assert fig["tpot_ms"] == pytest.approx(12.5) and fig["ttft_ms"] is None and fig["depth"] == 128
    assert fig["build"]["build_commit"] == "0c1e570"


def test_unequal_work_is_said_under_the_table() -> None:
    def m(server: str, rnd: int, completed: int, got: float, generated: float | None) -> serving_sides.Measured:
        fig = {"work": serving_sides.work_counts(64, completed, got, generated), "errors": ["Server disconnected"]}
        return serving_sides.Measured(server, "equal settings", "greedy", 16, "workbench", rnd, fig)

    same = {"servelab": [m("servelab", 0, 64, 8192, 8192)], "llamacpp": [m("llamacpp", 0, 64, 8192, 8192)]}
    assert serving.work_differs(same) == []
    lost = {"servelab": [m("servelab", 0, 64, 8192, 8192)], "llamacpp": [m("llamacpp", 0, 60, 7680, 8100)]}
    notes = serving.work_differs(lost)
    assert notes[0] == "round 1: llamacpp completed 60 of 64 requests (Server disconnected)"
    assert notes[1] == "round 1: llamacpp generated 8100 tokens, its client received 7680"
    assert notes[2].startswith("round 1: unequal work, completed servelab 64, llamacpp 60")
    assert serving_sides.format_work(lost["llamacpp"][0].figures["work"]) == (
        "60/64 completed, 7680 tokens received, the server generated 8100")


def test_a_server_that_oversubscribes_itself_is_named_slow_in_every_round() -> None:
    """vLLM-CPU with no core kept for its API server: ~3.3 of its threads runnable on 2 cores in
    every round, so no round falls off the median; each is named slow by that cause."""
    import round_conditions as rc

    fig = {"output_throughput": 100.0, "median_ttft_ms": 400.0, "median_tpot_ms": 30.0}
    cond = rc.RoundConditions(runnable_mean=3.4, cores=2, server_runnable_mean=3.3).as_dict()
    slow = rc.slow_rounds([(r, fig, cond) for r in range(3)], serving.SLOW_FIGURES)
    assert [s["round"] for s in slow] == [0, 1, 2] and all(s["off"] == {} for s in slow)
    assert slow[0]["reasons"] == ["oversubscribed by the server itself: 3.3 of its threads runnable on average on "
                                  "2 cores (its threads waited for a core in turn)"]
    assert rc.format_slow_rounds("vllm", slow[:1])[0].startswith("slow round: vllm round 1 (its figures near the median")
    assert rc.slow_rounds([(0, fig, cond)], serving.SLOW_FIGURES)[0]["round"] == 0  # one round is enough
    bound = rc.RoundConditions(runnable_mean=2.1, cores=2, server_runnable_mean=1.6).as_dict()
    assert rc.slow_rounds([(r, fig, bound) for r in range(3)], serving.SLOW_FIGURES) == []


def test_the_sampler_counts_a_process_groups_own_runnable_threads() -> None:
    import subprocess
    import time

    import round_conditions as rc

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 5\nwhile time.time() < t: pass"],
                            start_new_session=True)
    try:
        time.sleep(0.2)
        assert rc.group_pids(spin.pid) == [spin.pid]
        with rc.RunnableSampler(interval_s=0.02, group=spin.pid) as s:
            time.sleep(0.4)
        assert s.server_mean is not None and 0 < s.server_mean <= 1.0  # one spinning thread, runnable or running
    finally:
        spin.kill()
        spin.wait()
    assert rc.runnable_threads([]) == 0


def test_a_measurement_with_no_completed_request_stops_the_run_with_its_errors(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    """A server that answers every request with an error (a wrong model name: HTTP 404) ends the run
    saying so, not with a format error on the missing figures."""

    class FakeServer:
        start_s, url, proc, name = 0.0, "http://127.0.0.1:1", None, "servelab"

        def __init__(self) -> None:
            self.log_path = tmp_path / "servelab.log"
            self.log_path.write_text("")

        def start(self) -> None: ...

        def stop(self) -> None: ...

    def failing_drive(server: FakeServer, specs: list, concurrency: int, sampling: str) -> dict:
        return {"output_throughput": 0.0, "median_ttft_ms": None, "median_tpot_ms": None,
                "errors": ["HTTP 404: The model `smollm2` does not exist."],
                "work": serving_sides.work_counts(len(specs), 0, 0.0, None)}  # fmt: skip

    monkeypatch.setattr(serving_sides, "drive", failing_drive)
    args = argparse.Namespace(sampling=["greedy"], concurrency=[16], num_requests=8, num_requests_c1=3, output_len=4,
                              peer="llamacpp")  # fmt: skip
    with pytest.raises(SystemExit, match=r"none of 8 requests completed .*does not exist"):
        serving_sides.run_round(FakeServer(), "servelab", "equal settings", 0,  # type: ignore[arg-type]
                                lambda seed, n: serving.random_prompts(n, 32, 49152, seed), args, bench=False)
