"""The Mooncake trace replayed through the engine's own scheduler and KV cache reaches the
prefix-cache hit rate that the trace's own block reuse predicts.

The first 300 requests, lengths scaled to the default model's context (the 512-token hash
blocks scaled with them to a multiple of the KV block size), a cache large enough that
nothing is evicted, and the simulated executor (the hit rate is a property of the
scheduler and the KV-cache manager, not of the model's arithmetic): within 3 points.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workloads.traces import fit_to_context, load_trace, mooncake_block_reuse, slice_rows

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
N = 300


@pytest.mark.skipif(not TRACE.exists(), reason="needs ../shared/traces/synthetic_trace.jsonl (the Mooncake trace)")
def test_mooncake_prefix_hit_rate_matches_trace_block_reuse(tmp_path: Path) -> None:
    run = tmp_path / "mooncake"
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.cli", "workload=mooncake", "target=simulated",
         f"workload.trace.path={TRACE}", f"workload.trace.max_requests={N}", "cache.num_blocks=40000",
         "cache.block_size=16", "scheduler.max_num_batched_tokens=8192", "scheduler.max_num_seqs=64",
         "profiling.telemetry=false", "run.time_reference=false", "report.html=false", f"hydra.run.dir={run}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    info = json.loads((run / "workload_info.json").read_text())["trace"]
    assert summary["completed"] == N and summary["num_preemptions"] == 0
    block = info["block_size"]
    assert block % 16 == 0 and info["length_mode"] == "scale"

    # the trace's own reuse over the same requests and the same scaled lengths
    rows, _ = load_trace(TRACE)
    rows = fit_to_context(slice_rows(rows, first_n=N), info["max_context"], "scale",
                          scale=info["length_scale"])
    expected = mooncake_block_reuse(rows, block_size=block)
    assert expected > 0.02  # the first 300 requests reuse ~5% (the whole trace 65%)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(expected, abs=0.03), (summary["prefix_cache_hit_rate"],
                                                                                   expected)
