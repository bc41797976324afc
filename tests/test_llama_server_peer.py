"""llama.cpp's own server, as the side-by-side benchmarks start it, serves concurrent requests at once.

issue 55: at c=16 the peer once was llama-cpp-python's server, which serves one request at a time,
and a "23x" was measured against that single slot. Here `llama-server` is started exactly as
`benchmarks/serving_throughput.py --peer llamacpp` starts it (serving_sides.llama_server: one slot
per concurrent request, continuous batching) on the default model's GGUF, 8 streams are sent at
once through the workbench's client, and their decode intervals (first token to last, on the
client's clock) must all overlap: some moment lies inside every one of them. The same check
against a one-slot server must find the streams one after another, so the check itself can tell
a single-slot peer from a batching one. Skips, naming `make peers-llamacpp`, where the binaries
are not built.

The server runs on one thread here: what is checked is concurrency, not speed, and on a 2-core
machine that other work keeps busy two spinning ggml threads wait on each other at every op's
barrier (1.8 s a batch-8 step seen here against 0.25 s on one thread), which would make the test
slow for no gain in what it shows.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import peers  # noqa: E402
import serving_sides  # noqa: E402

from analysis.record import RequestRecord  # noqa: E402
from workloads.driver import run_workload  # noqa: E402

MISSING = peers.llamacpp_missing()
STREAMS = 8
PROMPT_LEN, OUTPUT_LEN = 16, 24

pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"needs llama.cpp's llama-server: {MISSING}")


def _serve(tmp_path: Path, slots: int, n: int, output_len: int) -> list[RequestRecord]:
    """Start llama-server with `slots` slots, send `n` streams at once (greedy, EOS ignored,
    token-id prompts), stop it; the client's records."""
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model

    vocab = resolve_model(ModelConfig())[0].vocab_size
    prompts = serving_sides.random_prompts(n, PROMPT_LEN, vocab, seed=55 + slots)
    specs = serving_sides.specs_for(prompts, output_len, f"np{slots}")
    server = serving_sides.llama_server(tmp_path, slots, 256, 256, f"np{slots}", threads=1)
    server.start()
    try:
        target = serving_sides.client_for(server, "greedy")
        res = asyncio.run(run_workload(specs, target, concurrency=n))
    finally:
        server.stop()
    return list(res.records)


def _intervals(records: list[RequestRecord]) -> list[tuple[float, float]]:
    return [(r.token_times[0], r.token_times[-1]) for r in records]


def test_llama_server_decodes_8_streams_at_once(tmp_path: Path) -> None:
    records = _serve(tmp_path, STREAMS, STREAMS, OUTPUT_LEN)
    failed = [r.error for r in records if not r.ok]
    assert not failed, f"{len(failed)} of {STREAMS} streams failed: {failed[:3]}"
    assert [r.output_tokens for r in records] == [OUTPUT_LEN] * STREAMS  # ignore_eos: every token asked for
    spans = _intervals(records)
    last_start, first_end = max(a for a, _ in spans), min(b for _, b in spans)
    assert last_start < first_end, (
        f"the {STREAMS} streams' decode intervals do not all overlap (the last began decoding at "
        f"{last_start:.3f} s, the first finished at {first_end:.3f} s): llama-server did not serve them at once")

    # The control: one slot serves two streams one after the other, and the check says so.
    one = _intervals(_serve(tmp_path, 1, 2, 4))
    assert max(a for a, _ in one) > min(b for _, b in one)
