"""Bursty and quantized traces in servelab-trace (issue 60 item 1; workloads/trace_arrivals.py).

A trace logged in batches (every 3 s a batch of requests under one timestamp) used to be read
as more regular than Poisson: the gamma fitted to its positive gaps (all 3 s) had a shape near
1e7, and `synthesize` wrote evenly spaced arrivals. Here such a trace, built by hand, and a
Poisson one go through the command line: the analysis must name the 3 s grid, the batches and
the dispersion of the counts, and say that the gamma does not describe the gaps; the copy must
keep the batches (sizes and gaps) at the scaled rate. The Poisson trace must come out as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from workloads.trace_cli import main as trace_main
from workloads.trace_tools import write_jsonl
from workloads.traces import TraceRow, load_trace

PERIOD_S = 3.0


def _bursts(n_batches: int = 400, seed: int = 0) -> tuple[list[TraceRow], np.ndarray]:
    """A batch of requests every PERIOD_S seconds, geometric sizes of mean 10."""
    sizes = np.random.default_rng(seed).geometric(0.1, n_batches)
    ts = np.repeat(np.arange(n_batches) * PERIOD_S, sizes)
    return [TraceRow(float(t), 100 + i % 37, 20) for i, t in enumerate(ts)], sizes


def _poisson(n: int = 4000, rate: float = 2.0, seed: int = 1) -> list[TraceRow]:
    ts = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    return [TraceRow(float(t - ts[0]), 100 + i % 37, 20) for i, t in enumerate(ts)]


def _analyze(rows: list[TraceRow], tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    src = tmp_path / f"{name}.jsonl"
    write_jsonl(rows, src)
    out = tmp_path / f"{name}.analysis.json"
    assert trace_main(["analyze", str(src), "--out", str(out)]) == 0
    return json.loads(out.read_text())["arrivals"], capsys.readouterr().out


def _synthesize(rows: list[TraceRow], tmp_path: Path, name: str, rate_scale: float) -> list[TraceRow]:
    src = tmp_path / f"{name}.jsonl"
    write_jsonl(rows, src)
    out = tmp_path / f"{name}.synth.jsonl"
    assert trace_main(["synthesize", str(src), "--num-requests", str(len(rows)), "--rate-scale", str(rate_scale),
                       "--seed", "3", "--out", str(out)]) == 0  # fmt: skip
    synth, _ = load_trace(out)
    return synth


def test_a_trace_of_bursts_every_3_s_is_named_bursty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, sizes = _bursts()
    arr, printed = _analyze(rows, tmp_path, "bursts", capsys)
    ts = np.array([r.timestamp_s for r in rows])
    assert arr["interarrival_cv"] == pytest.approx(np.diff(ts).std() / np.diff(ts).mean())
    assert arr["interarrival_cv"] > 3  # the gaps are bursty; the old report called them regular
    assert arr["resolution_s"] == pytest.approx(PERIOD_S)
    assert arr["tied_share"] == pytest.approx((len(rows) - len(sizes)) / (len(rows) - 1))  # zero gaps / gaps
    batches = arr["batches"]
    assert batches["count"] == len(sizes)
    assert batches["size"]["mean"] == pytest.approx(sizes.mean()) and batches["size"]["max"] == sizes.max()
    assert batches["gap_s"]["mean"] == pytest.approx(PERIOD_S) and batches["gap_s"]["cv"] == pytest.approx(0, abs=1e-9)
    # counts per 3 s window are the batch sizes (the last window, partial, left out): their
    # variance / mean, ~9 for a geometric(0.1)
    grid = {round(d["window_s"], 6): d["index_of_dispersion"] for d in arr["dispersion"]}
    whole = sizes[:-1]
    assert grid[PERIOD_S] == pytest.approx(whole.var() / whole.mean(), rel=1e-6) and grid[PERIOD_S] > 3
    assert arr["gamma_describes_gaps"] is False and "sharing a timestamp" in arr["gamma_note"]
    assert arr["arrival_model"] == "batches"
    assert "3 s grid" in printed and "does not describe" in printed, printed


def test_synthesize_keeps_the_bursts(tmp_path: Path) -> None:
    rows, sizes = _bursts()
    synth = _synthesize(rows, tmp_path, "bursts", rate_scale=2.0)
    assert len(synth) == len(rows)
    ts = np.array([r.timestamp_s for r in synth])
    times, counts = np.unique(ts, return_counts=True)
    # the batches: every gap between them is the source's 3 s at twice the rate, their sizes the source's
    assert np.allclose(np.diff(times), PERIOD_S / 2, atol=1e-5)
    assert set(counts[:-1].tolist()) <= set(sizes.tolist())  # (the last batch is cut to make n)
    assert counts.mean() == pytest.approx(sizes.mean(), rel=0.05)
    assert np.percentile(counts, 90) == pytest.approx(np.percentile(sizes, 90), rel=0.15)
    src_rate = (len(rows) - 1) / rows[-1].timestamp_s
    assert (len(ts) - 1) / ts[-1] == pytest.approx(2 * src_rate, rel=0.05)
    src_gaps, gaps = np.diff([r.timestamp_s for r in rows]), np.diff(ts)
    assert gaps.std() / gaps.mean() == pytest.approx(src_gaps.std() / src_gaps.mean(), rel=0.1)


def test_a_poisson_trace_is_still_poisson(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _poisson()
    arr, printed = _analyze(rows, tmp_path, "poisson", capsys)
    assert arr["resolution_s"] is None and arr["tied_share"] == 0 and arr["batches"]["size"]["max"] == 1
    assert arr["gamma_shape"] == pytest.approx(1.0, abs=0.06) and arr["gamma_describes_gaps"] is True
    assert arr["arrival_model"] == "gamma"
    widths = [d for d in arr["dispersion"] if arr["span_s"] / d["window_s"] >= 100]
    assert len(widths) >= 2
    for d in widths:  # Poisson counts: variance = mean at every width
        assert d["index_of_dispersion"] == pytest.approx(1.0, abs=0.2), d
    assert "does not describe" not in printed

    synth = _synthesize(rows, tmp_path, "poisson", rate_scale=2.0)
    ts = np.array([r.timestamp_s for r in synth])
    gaps = np.diff(ts)
    assert (gaps > 0).all()  # no batches made up
    assert (len(ts) - 1) / ts[-1] == pytest.approx(2 * (len(rows) - 1) / rows[-1].timestamp_s, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
