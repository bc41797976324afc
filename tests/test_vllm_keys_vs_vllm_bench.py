"""The workbench's vLLM-named figures against `vllm bench serve`'s (issue 35 item 3): the
deterministic half.

One servelab-serve (the default small model, its engine on one core), the 32 prompts and per-prompt
output lengths of benchmarks/vllm_keys_agreement.py, sent once by `vllm bench serve` (vLLM's CPU
build in the side venv `make peers` makes) with `--save-detailed`, and once by the workbench's
driver and `openai` target. Both must complete every request with the same token counts, and the
workbench's `summarize` over vLLM's own saved requests (start, TTFT, chunk gaps, latency, token
counts) must give vLLM's own figure for every vLLM-named key, to float rounding (the throughputs
over vLLM's duration, which also spans its dispatch and gather). No timing noise enters: this is
where a definition that differs shows.

The timing half, both clients' medians over five ABBA rounds on one server, is a benchmark
(`benchmarks/vllm_keys_agreement.py`): two clients' latencies on a shared 2-core machine spread by up
to 20% a round, and a unit test does not assert timings (a 5-round rank test over 8 keys failed on
noise: 2026-12-07, median ITL 42 vs 53 ms with both sides' rounds overlapping).

Skips, naming what is missing, where the side venv or its model folder is absent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from vllm_keys_agreement import (  # noqa: E402
    NUM_PROMPTS,
    OUTPUT_LENS,
    VllmBench,
    disagreements,
    missing,
    same_requests_mismatches,
    served_model,
    workbench_summary,
    write_dataset,
)

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_summarize_over_vllms_own_requests_gives_vllms_figures(tmp_path: Path) -> None:
    lacking = missing()
    if lacking:
        pytest.skip(f"vllm bench serve comparison {lacking}")
    from server_utils import start_server

    dataset = write_dataset(tmp_path / "prompts.json")
    bench = VllmBench()
    server = start_server(tmp_path)  # the engine on one core (its default here)
    try:
        model = served_model(server.base_url)
        theirs = bench.run(server.base_url, model, dataset, tmp_path, "vllm0")
        ours = workbench_summary(server.base_url, model)
    finally:
        bench.close()
        assert server.stop() == 0, server.log()
    total = sum(OUTPUT_LENS)
    assert theirs["completed"] == NUM_PROMPTS and theirs["total_output_tokens"] == total, theirs["completed"]
    assert ours["completed"] == NUM_PROMPTS and ours["total_output_tokens"] == total, ours["completed"]
    assert ours["total_input_tokens"] == theirs["total_input_tokens"]  # the same prompts, tokenized alike
    assert same_requests_mismatches(theirs) == {}


def _summaries(key: str, values: list[float]) -> list[dict]:
    from vllm_keys_agreement import KEYS

    return [{k: (v if k == key else 1.0) for k in KEYS} for v in values]


def test_a_key_is_flagged_only_when_the_rounds_are_apart_and_the_medians_differ() -> None:
    key = "median_itl_ms"
    apart = disagreements(_summaries(key, [40, 41, 42, 43, 44]), _summaries(key, [50, 51, 52, 53, 54]))
    assert set(apart) == {key} and "p=0.008" in apart[key]
    # the failing run of 2026-12-07: medians 20% apart, but the rounds interleave (p=0.032 < 0.05): flagged
    mixed = disagreements(_summaries(key, [42.3, 46.3, 52.1, 40.8, 42.0]), _summaries(key, [53.0, 44.5, 52.8, 54.8, 56.3]))
    assert set(mixed) == {key}
    # rounds wholly apart but within 5%: not flagged
    close = disagreements(_summaries(key, [50.0, 50.1, 50.2, 50.3, 50.4]), _summaries(key, [51, 51.1, 51.2, 51.3, 51.4]))
    assert close == {}
