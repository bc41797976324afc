"""StepProfiler, the kernel table and the telemetry sampler, on CPU."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from profiling.engine_hooks import StepProfilerHooks
from profiling.kernel_table import categorize, kernel_table, per_step, phase_durations
from profiling.telemetry import TelemetrySampler
from profiling.torch_profiler import StepProfiler


class TinyBlock(torch.nn.Module):
    """RMS norm, causal attention and a SiLU MLP: every kernel category appears."""

    def __init__(self, dim: int = 512, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, prof: StepProfiler, step: int) -> torch.Tensor:
        # x: [tokens, dim]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # each [tokens, dim]
        t, d = q.shape
        with prof.phase("attention", step):
            # [heads, tokens, head_dim]
            q, k, v = (z.view(t, self.heads, d // self.heads).transpose(0, 1) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(0, 1).reshape(t, d)
        x = x + a
        return x + self.down(F.silu(self.up(x)))


def _profile_model(run_dir, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model, x = TinyBlock(), torch.randn(512, 512)
    with torch.no_grad(), StepProfiler(run_dir, wait=1, warmup=1, active=2) as prof:
        for step in range(steps):
            with prof.step_range(step):
                with prof.phase("forward", step):
                    y = model(x, prof, step)
                with prof.phase("sample", step):
                    torch.argmax(torch.softmax(y, dim=-1), dim=-1)
            prof.profiler_step()
    return json.loads((run_dir / "trace.json").read_text())


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("prof")
    return run_dir, _profile_model(run_dir)


def test_trace_and_kernels_csv_written(profiled):
    run_dir, trace = profiled
    assert trace["traceEvents"]
    kernels = pd.read_csv(run_dir / "kernels.csv")
    assert list(kernels.columns) == ["step", "category", "time_ms"]
    assert sorted(kernels["step"].unique()) == [2, 3]  # wait=1, warmup=1, active=2
    cats = set(kernels["category"])
    assert {"gemm", "attention", "norm_act", "sampling"} <= cats
    assert (kernels["time_ms"] >= 0).all()


def test_forward_kernel_time_matches_forward_range(profiled):
    _, trace = profiled
    table = kernel_table(trace["traceEvents"])
    ranges = phase_durations(trace["traceEvents"])
    ratios = []
    for step in (2, 3):
        fwd_ms = ranges[(ranges["step"] == step) & (ranges["phase"] == "forward")]["duration_ms"].item()
        in_step = table[table["step"] == step]
        ops_ms = in_step[in_step["phase"] == "forward"]["time_ms"].sum()
        ratios.append(ops_ms / fwd_ms)
        # sdpa ran in the attention range: attention time is a real share of forward
        attn = in_step[in_step["category"] == "attention"]["time_ms"].sum()
        assert 0 < attn < ops_ms
    # Leaf self times never exceed the range; the gaps between ops are Python overhead
    # (~2% here). On a loaded shared CI machine a descheduled gap can inflate one step,
    # so the 5% acceptance is asserted on the best profiled step, 15% on every step.
    assert max(ratios) == pytest.approx(1.0, abs=0.05), ratios
    assert all(0.85 < r <= 1.0 + 1e-6 for r in ratios), ratios


def test_self_time_does_not_double_count():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "servelab::step#step=0", "ts": 0, "dur": 100, "tid": 1},
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "servelab::forward#step=0",
            "ts": 1,
            "dur": 90,
            "tid": 1,
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 10, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 15, "dur": 40, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 60, "dur": 5, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 5, "tid": 1},  # outside any step
    ]
    table = kernel_table(ev)
    ops = table[table["category"] != "host"]
    assert ops["time_ms"].sum() == pytest.approx(0.055)
    agg = per_step(table).set_index("category")["time_ms"]
    assert agg["gemm"] == pytest.approx(0.050)  # linear self 10 us + addmm 40 us
    assert agg["copy"] == pytest.approx(0.005)
    # the forward range (90 us) minus its ops' self times (55 us): Python between ops
    assert agg["host"] == pytest.approx(0.035)
    assert table["time_ms"].sum() == pytest.approx(0.090)


def test_gpu_kernels_placed_by_launch():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "servelab::step#step=7", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "servelab::sample#step=7", "ts": 50, "dur": 40},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 60, "dur": 3, "args": {"correlation": 9}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::topk", "ts": 55, "dur": 20},
        # runs on the GPU after the CPU step range ended
        {"ph": "X", "cat": "kernel", "name": "void at::native::radixSortKernel", "ts": 400, "dur": 30,
         "args": {"correlation": 9}},
    ]  # fmt: skip
    table = kernel_table(ev)
    assert table.to_dict("records") == [
        {"step": 7, "phase": "sample", "context": "sample", "name": "void at::native::radixSortKernel",
         "category": "sampling", "time_ms": pytest.approx(0.03)},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "context", "category"),
    [
        ("aten::addmm", "forward", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "forward", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "forward", "attention"),
        ("aten::softmax", "attention", "attention"),
        ("aten::softmax", "sample", "sampling"),
        ("aten::softmax", "forward", "norm_act"),
        ("_paged_attn_decode_kernel", "forward", "attention"),
        ("aten::multinomial", "forward", "sampling"),
        ("aten::rsqrt", "forward", "norm_act"),
        ("aten::silu", "forward", "norm_act"),
        ("aten::index_select", "prepare_inputs", "copy"),
        ("aten::to", "forward", "copy"),
        ("aten::view", "forward", "other"),
    ],
)
def test_categorize(name, context, category):
    assert categorize(name, context) == category


def test_engine_hooks_protocol(tmp_path):
    hooks = StepProfilerHooks(StepProfiler(tmp_path, wait=0, warmup=1, active=2))
    a = torch.randn(64, 64)
    for step in range(3):
        hooks.step_begin(step)
        for name in ("schedule", "forward", "sample"):
            with hooks.phase(name):
                a = a @ a.T / 64
        hooks.step_end()
    hooks.close()
    kernels = pd.read_csv(tmp_path / "kernels.csv")
    assert set(kernels["step"]) == {1, 2}
    assert "gemm" in set(kernels["category"])


def test_telemetry_without_gpu_records_reason(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.05) as sampler:
        time.sleep(0.2)
    info = json.loads((tmp_path / "telemetry.json").read_text())
    df = pd.read_csv(tmp_path / "telemetry.csv")
    assert sampler.num_samples >= 2
    assert len(df) >= sampler.num_samples  # one row per sample (per GPU when there are GPUs)
    assert (df["rss_mb"] > 1).all()
    assert df["time"].is_monotonic_increasing
    if info["gpu"]:
        assert df["gpu_mem_used_mb"].notna().all()
    else:
        assert info["reason"]
        assert df["gpu_util_pct"].isna().all()


def test_telemetry_of_another_process_tree_counts_its_children(tmp_path):
    """With `pid`, RSS is that process's tree (a server and its EngineCore), not the harness's (defect 6)."""
    import subprocess
    import sys

    import pandas as pd

    from profiling.telemetry import TelemetrySampler

    # A parent holding ~50 MiB that starts a child holding ~150 MiB.
    child = "b = b'x' * (150 * 2**20); import time; time.sleep(60)"  # written: resident
    parent = (f"import subprocess, sys, time; b = b'x' * (50 * 2**20); "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        import psutil

        for _ in range(600):  # up to 30 s on a busy machine
            kids = psutil.Process(proc.pid).children()
            if kids and kids[0].memory_info().rss > 140 * 2**20:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the child process never grew to 150 MiB")
        sampler = TelemetrySampler(tmp_path, interval_s=0.05, pid=proc.pid).start()
        time.sleep(0.2)
        sampler.stop()
    finally:
        for kid in psutil.Process(proc.pid).children(recursive=True):
            kid.kill()
        proc.kill()
        proc.wait()
    df = pd.read_csv(tmp_path / "telemetry.csv")
    assert (df["rss_mb"] > 190).all(), df["rss_mb"].tolist()
