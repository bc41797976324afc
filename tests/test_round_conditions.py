"""Why a round of a side-by-side benchmark was slow (issue 38, item 4): benchmarks/round_conditions.py.

The causes seen on the 2-core machines (a start-up probe that picked another kernel, another
process busy or a server left running, more runnable threads than cores) are recorded per round
and named for the rounds whose figures fall more than 5% off the median of the rounds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import round_conditions as rc  # noqa: E402
import serving_throughput as serving  # noqa: E402


def test_the_front_end_logs_the_cores_kernel_choices_and_the_benchmark_reads_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The core reports its start-up choices with READY; the front end logs them as one line (what
    a server's log holds); round_conditions reads that line back."""
    from engine.config import EngineConfig
    from engine.frontend.async_llm import AsyncLLM
    from engine.kernels.kernel_choices import format_choices, parse_choices

    shape = tmp_path / "tiny.yaml"  # a tiny random-weight model (tests/test_limits.py's shape)
    shape.write_text(yaml.safe_dump({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 64,
                                     "max_position_embeddings": 256}))  # fmt: skip
    cfg = EngineConfig.from_kwargs(str(shape), dtype="float32", num_blocks=16)
    caplog.set_level(logging.INFO, logger="engine.frontend.async_llm")
    llm = AsyncLLM.from_config(cfg, multiprocess=False, ready_timeout_s=120)
    try:
        assert llm.client.ready is not None
        reported = llm.client.ready.choices
    finally:
        llm.shutdown()
    assert reported["dtype"] == "float32" and int(reported["threads"]) >= 1
    assert reported["float32_linear"] in ("blas", "onednn-prepacked", "onednn-prepacked+gemv")
    line = next(r.getMessage() for r in caplog.records if "start-up choices" in r.getMessage())
    assert line == format_choices(reported) and parse_choices(line) == reported
    log = f"2026-12-05 20:32:38,294 INFO engine.frontend.async_llm: {line}\n2026-12-05 INFO servelab.serve: serving\n"
    assert rc.startup_choices(log) == reported
    assert rc.startup_choices("vLLM API server version 0.32.0\nINFO: Uvicorn running") == {}


def _cond(choice: str = "prepacked", busy: list | None = None, runnable: float | None = 2.0,
          steal: float | None = None) -> dict:  # fmt: skip
    return rc.RoundConditions(choices={"float32_linear": f"{choice} (probe: oneDNN 1.30x the BLAS)",
                                       "dtype": "float32 (pinned)"},
                              busy=busy or [], runnable_mean=runnable, steal=steal, cores=2).as_dict()


def test_slow_rounds_are_named_with_what_differed() -> None:
    fig = {"output_throughput": 500.0, "median_ttft_ms": 260.0, "median_tpot_ms": 30.0}
    busy = [{"pid": 4242, "name": "python", "cpu_share": 0.85, "server": False, "cmd": "python spin.py"}]
    left = [{"pid": 77, "name": "servelab-serve", "cpu_share": 0.0, "server": True, "cmd": "servelab-serve --port 1"}]
    rounds = [
        (0, fig, _cond()),
        (1, {**fig, "output_throughput": 440.0}, _cond(choice="plain")),  # -12%: another kernel
        (2, {**fig, "median_ttft_ms": 300.0}, _cond(busy=busy)),  # TTFT +15%: a busy neighbour
        (3, fig, _cond()),
        (4, {**fig, "median_tpot_ms": 33.0}, _cond(runnable=3.6)),  # TPOT +10%: 3.6 runnable on 2 cores
        (5, {**fig, "output_throughput": 470.0}, _cond()),  # -6%, nothing recorded
        (6, {**fig, "output_throughput": 490.0}, _cond(busy=left)),  # -2%: not slow, not listed
        (7, {**fig, "median_tpot_ms": 36.0}, _cond(steal=0.12)),  # TPOT +20%: a neighbour on the host
    ]
    slow = {s["round"]: s for s in rc.slow_rounds(rounds, serving.SLOW_FIGURES)}
    assert sorted(slow) == [1, 2, 4, 5, 7]
    assert slow[7]["reasons"] == ["CPU steal: the hypervisor gave 12.0% of the CPU time to other guests"]
    assert slow[1]["off"] == {"output_throughput": pytest.approx(440 / 500 - 1)}
    assert slow[1]["reasons"] == ["start-up choice float32_linear: plain (probe: oneDNN 1.30x the BLAS), the other "
                                  "rounds prepacked (pin it with kernels.float32_linear=prepacked|plain (or SERVELAB_ONEDNN_FP32=1|0))"]
    assert slow[2]["reasons"] == ["busy outside the benchmark: pid 4242 python (85% of a core) python spin.py"]
    assert slow[4]["reasons"] == ["oversubscribed: 3.6 runnable threads on average on 2 cores (the other rounds 2.0)"]
    assert slow[5]["reasons"][0].startswith("no recorded cause")
    lines = serving.format_slow_rounds("servelab", list(slow.values()))
    assert lines[0].startswith("slow round: servelab round 2 (out tok/s -12.0% against the median): start-up choice")
    assert "TTFT p50 +15.4%" in lines[1]
    assert rc.slow_rounds(rounds[:2], serving.SLOW_FIGURES) == []  # fewer than 3 rounds: no median to be off


def _banded(low_count: int, n: int = 64) -> list[float]:
    """n TTFTs in two bands a prefill step apart: low_count of them around 210 ms, the rest 240."""
    return sorted([205.0 + 0.1 * i for i in range(low_count)] + [238.0 + 0.1 * i for i in range(n - low_count)])


def test_a_ttft_median_at_a_step_among_the_requests_is_named() -> None:
    """At c=16 per-request TTFTs sit in bands a prefill step apart; a round whose median lands one
    band up because a few requests fell on the other side says so, with where the step is; a round
    slow on TTFT with no step near its median, or slow on TPOT only, does not."""
    assert rc.median_step(_banded(34)) == {"low": pytest.approx(208.3), "high": 238.0, "below": 34, "n": 64}
    assert rc.median_step(_banded(34)[:5]) is None  # too few requests to speak of a median's neighbours
    assert rc.median_step(_banded(10)) is None  # the step lies far from the median: not what moves it
    assert rc.median_step([200.0 + i for i in range(64)]) is None  # evenly spread: no step
    fig = {"output_throughput": 500.0, "median_ttft_ms": 212.0, "median_tpot_ms": 30.0}
    rounds = [(r, {**fig, "ttft_ms": _banded(34)}, _cond()) for r in range(3)]
    rounds.append((3, {**fig, "median_ttft_ms": 239.0, "ttft_ms": _banded(30)}, _cond()))  # four requests up
    rounds.append((4, {**fig, "median_ttft_ms": 239.0, "ttft_ms": [230.0 + i for i in range(64)]}, _cond()))
    rounds.append((5, {**fig, "median_tpot_ms": 33.0, "ttft_ms": _banded(30)}, _cond()))
    slow = {s["round"]: s for s in rc.slow_rounds(rounds, serving.SLOW_FIGURES)}
    assert sorted(slow) == [3, 4, 5]
    assert slow[3]["reasons"] == [
        "TTFT p50 at a step among the requests' TTFTs: 30 of 64 at or under 208 ms, the rest from 238 ms "
        "(requests arrive in groups and are prefilled a step apart: the median moves by that step when a few "
        "requests land on the other side of it, not with the server's speed)"]
    assert slow[4]["reasons"][0].startswith("no recorded cause")
    assert slow[5]["reasons"][0].startswith("no recorded cause")


def test_a_round_whose_step_bytes_read_slower_says_so() -> None:
    """A batch-1 step's bytes can sit in the last-level cache: a round before which a buffer of that
    size read >10% slower than before the other rounds names it; 5% slower is not named."""
    def cond(rate: float) -> dict:
        return rc.RoundConditions(runnable_mean=2.0, steal=0.0, cores=2, step_read_rate=rate).as_dict()

    figs = {"tpot_ms": 3.3, "ttft_ms": 31.0}
    rounds = [(0, figs, cond(54e9)), (1, {**figs, "tpot_ms": 4.7}, cond(38e9)), (2, figs, cond(55e9)),
              (3, {**figs, "tpot_ms": 3.7}, cond(52e9))]  # fmt: skip
    slow = {s["round"]: s for s in rc.slow_rounds(rounds, {"tpot_ms": False, "ttft_ms": False})}
    assert sorted(slow) == [1, 3]
    assert slow[1]["reasons"] == ["the step's bytes read at 38.0 GB/s just before this round, the other rounds "
                                  "54.0 (other work on the host's last-level cache)"]
    assert slow[3]["reasons"][0].startswith("no recorded cause")


def test_a_left_server_is_named_even_when_idle() -> None:
    left = [{"pid": 77, "name": "python", "cpu_share": 0.0, "server": True, "cmd": "servelab-serve --port 1"}]
    assert rc.reasons(_cond(busy=left), [_cond()]) == [
        "a server left running: pid 77 python (0% of a core) servelab-serve --port 1"]
    assert rc.reasons(_cond(runnable=2.4), [_cond()]) == []  # within half a thread of the cores: not counted


def _detached(*args: str) -> int:
    """A process that is not this one's child (its parent exits): how a neighbour or a left server
    looks. Returns its pid."""
    code = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], start_new_session=True, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_busy_processes_finds_a_neighbour_and_a_left_server_but_not_its_own() -> None:
    spin = _detached(sys.executable, "-c", "import time\nt = time.time() + 30\nwhile time.time() < t: pass")
    idle = _detached(sys.executable, "-c", "import time; time.sleep(30)", "servelab-serve", "--port", "1")
    own = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 30\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.3)
        found = {p["pid"]: p for p in rc.busy_processes(window_s=1.0)}
        assert spin in found and found[spin]["cpu_share"] >= rc.BUSY_SHARE and not found[spin]["server"]
        assert idle in found and found[idle]["server"]
        assert own.pid not in found and os.getpid() not in found and os.getppid() not in found  # ours, what started us
    finally:
        own.kill()
        for pid in (spin, idle):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_runnable_sampler_reads_proc_stat(tmp_path: Path) -> None:
    fake = tmp_path / "stat"
    fake.write_text("cpu  100 0 50 800 0 0 0 50 0 0\nprocs_running 4\nprocs_blocked 0\n")
    with rc.RunnableSampler(interval_s=0.01, stat=fake) as s:
        time.sleep(0.1)
        fake.write_text("cpu  160 0 70 900 0 0 0 70 0 0\nprocs_running 4\nprocs_blocked 0\n")  # 20 of 200 stolen
    assert s.samples and s.mean == 3.0  # the sampler's own thread is not counted
    assert s.steal == pytest.approx(0.1)
    with rc.RunnableSampler(interval_s=0.01, stat=tmp_path / "missing") as s:
        time.sleep(0.05)
    assert s.mean is None and s.steal is None
    if Path("/proc/stat").exists():
        with rc.RunnableSampler(interval_s=0.01) as s:
            time.sleep(0.1)
        assert s.mean is not None and s.mean >= 0


def test_what_looks_like_a_server() -> None:
    for cmd in (["python", "-m", "engine.entrypoints.serve", "--port", "8000"], ["/usr/bin/servelab-serve"],
                ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], ["vllm", "serve", "m"],
                ["python", "-m", "llama_cpp.server", "--model", "m.gguf"], ["./llama-server", "-m", "m.gguf"]):
        assert rc.looks_like_server(cmd), cmd
    # the benchmark's own command (run under `timeout`) names its peer: not a server
    assert not rc.looks_like_server(["timeout", "1500", "python", "benchmarks/serving_throughput.py", "--peer", "vllm"])


def test_the_report_gives_each_servers_runnable_threads() -> None:
    servers = {"servelab": {"conditions": [_cond(runnable=2.2), _cond(runnable=2.3), _cond(runnable=2.1)]},
               "vllm": {"conditions": [_cond(runnable=3.3), _cond(runnable=None), _cond(runnable=3.5)]}}
    assert serving.format_runnable(servers) == ("runnable threads while measured (median of the rounds' means, "
                                                "2 cores): servelab 2.2, vllm 3.4")
    servers["servelab"]["conditions"] = [_cond(runnable=2.2, steal=0.01), _cond(runnable=2.3, steal=0.09)]
    assert serving.format_runnable(servers).endswith("; CPU steal (median, range of the rounds): servelab 5.0% "
                                                     "(1.0%-9.0%)")
    assert serving.format_runnable({"servelab": {"conditions": []}}) == ""


def test_a_failure_to_name_the_choices_does_not_stop_the_engine(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from engine.config import EngineConfig
    from engine.core import core_proc

    def broken(config: EngineConfig) -> dict[str, str]:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(core_proc, "startup_choices", broken)
    engine = type("E", (), {"config": EngineConfig()})()
    with caplog.at_level(logging.WARNING, logger="engine.core.core_proc"):
        assert core_proc._choices(engine) == {}
    assert "probe exploded" in caplog.text
    assert core_proc._choices(object()) == {}
