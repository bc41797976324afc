"""The workbench's client clock against a minimal client on a busy machine (issue 60 item 11).

One servelab-serve taking both cores (4 tokens a chunk), 16 requests of 64 / 64 tokens at a
concurrency of 4, sent in alternation (ABBA) by tests/minimal_client.py (measuring as `vllm bench
serve` does) and by the workbench's driver and openai target as `servelab-run` sets them up (the
servelab timing header, /metrics scraped every 0.5 s), so the shared machine's noise falls on
both. The workbench's median TTFT must be within 5% of the minimal client's, or the two clients'
rounds indistinguishable (two-sided Mann-Whitney U, p >= 0.05), as in
tests/test_vllm_keys_vs_vllm_bench.py. The driver's lateness of each round is printed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import urllib.request
from pathlib import Path

import pytest
from minimal_client import median_ttft_ms, run_minimal

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.serial]

NUM, CONCURRENCY, IN, OUT, ROUNDS = 16, 4, 64, 64, 4
TOLERANCE, ALPHA = 0.05, 0.05
PROMPTS = [[(i * 7919 + j * 104729) % 30000 + 100 for j in range(IN)] for i in range(NUM)]


def _workbench(base_url: str, model: str) -> tuple[float, float]:
    """(median TTFT ms, the driver's largest lateness ms) of one round, as servelab-run drives it."""
    from analysis.metrics import summarize
    from workloads.driver import Driver
    from workloads.spec import RequestSpec
    from workloads.targets.openai import OpenAITarget

    specs = [RequestSpec(f"r{i}", 0.0, None, p, IN, OUT, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    target = OpenAITarget(base_url, model, extra_body={"temperature": 0.0}, server_timing=True)

    async def go():  # type: ignore[no-untyped-def]
        await target.start()
        try:
            return await Driver(target, concurrency=CONCURRENCY, scrape_interval_s=0.5).run(specs)
        finally:
            await target.stop()

    result = asyncio.run(go())
    return float(summarize(result.records)["median_ttft_ms"]), 1000 * max(r.lateness_s for r in result.records)


def test_workbench_ttft_matches_a_minimal_client_on_a_busy_machine(tmp_path: Path) -> None:
    from scipy.stats import mannwhitneyu
    from server_utils import start_server

    server = start_server(tmp_path, "server.stream_chunk_tokens=4", omp_threads=None)  # both cores
    try:
        with urllib.request.urlopen(server.base_url + "/v1/models", timeout=10) as resp:
            model = str(json.loads(resp.read())["data"][0]["id"])
        asyncio.run(run_minimal(server.base_url, model, PROMPTS[:CONCURRENCY], 8, CONCURRENCY))  # warm-up
        ours, minimal, late = [], [], []
        for k in range(ROUNDS):
            for side in ("minimal", "workbench") if k % 2 == 0 else ("workbench", "minimal"):
                if side == "minimal":
                    minimal.append(median_ttft_ms(asyncio.run(run_minimal(server.base_url, model, PROMPTS, OUT,
                                                                          CONCURRENCY))))  # fmt: skip
                else:
                    ttft, lateness = _workbench(server.base_url, model)
                    ours.append(ttft)
                    late.append(lateness)
    finally:
        assert server.stop() == 0, server.log()
    ratio = statistics.median(ours) / statistics.median(minimal)
    p = float(mannwhitneyu(ours, minimal, alternative="two-sided").pvalue)
    line = (f"median_ttft_ms: workbench {statistics.median(ours):.1f} vs minimal {statistics.median(minimal):.1f} "
            f"({ratio - 1:+.1%}, p={p:.3f}); rounds {[round(x) for x in ours]} / {[round(x) for x in minimal]}; "
            f"driver lateness max ms {[round(x, 1) for x in late]}")  # fmt: skip
    print(line)
    assert abs(ratio - 1) <= TOLERANCE or p >= ALPHA, line
