"""Trace loaders, transforms and statistics, checked against ../shared/traces/README.md."""

import json
from pathlib import Path

import numpy as np
import pytest

from workloads.prompts import PromptBuilder
from workloads.trace_workload import trace_workload
from workloads.traces import (
    block_repeat_fraction,
    fit_to_context,
    load_trace,
    mooncake_block_reuse,
    scale_time,
    slice_rows,
    trace_summary,
)

TRACES = Path(__file__).resolve().parents[1] / "../shared/traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no ../shared/traces")


class WordTokenizer:
    """Ids = positions in a growing word list; decode joins with spaces (round-trips)."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.index: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = []
        for w in text.split():
            if w not in self.index:
                self.index[w] = len(self.words)
                self.words.append(w)
            out.append(self.index[w])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


@pytest.fixture(scope="module")
def mooncake():
    return load_trace(TRACES / "synthetic_trace.jsonl")


# (file, rows, span_min, rate, cv, prompt_p50, prompt_p99, output_p50, output_max) from the README
AZURE = [
    ("AzureLLMInferenceTrace_conv.csv", 19_366, 58.4, 5.53, 1.09, 1020, 4142, 129, 1000),
    ("AzureLLMInferenceTrace_code.csv", 8_819, 57.3, 2.57, 13.2, 1469, 7436, 13, None),
]


@needs_traces
@pytest.mark.parametrize(("name", "rows", "span", "rate", "cv", "p50", "p99", "o50", "omax"), AZURE)
def test_azure_matches_readme(name, rows, span, rate, cv, p50, p99, o50, omax):
    data, info = load_trace(TRACES / name)
    assert info.format == "azure" and info.rows_read == rows
    s = trace_summary(data)
    assert s["rows"] == rows
    assert round(s["span_min"], 1) == span and round(s["rate"], 2) == rate
    assert s["interarrival_cv"] == pytest.approx(cv, abs=0.05)
    assert (s["prompt_p50"], s["prompt_p99"], s["output_p50"]) == (p50, p99, o50)
    if omax is not None:
        assert s["output_max"] == omax


@needs_traces
def test_azure_timestamps_keep_microseconds():
    data, _ = load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv")
    # rows 1-2: 18:15:46.6805900 and 18:15:50.9951690 (7th digit dropped)
    assert data[1].timestamp_s - data[0].timestamp_s == pytest.approx(4.314579, abs=1e-9)


@needs_traces
def test_mooncake_matches_readme(mooncake):
    data, info = mooncake
    s = trace_summary(data)
    assert info.format == "mooncake" and s["rows"] == 3_993
    assert round(s["span_min"], 1) == 17.0 and round(s["rate"], 2) == 3.91
    assert s["prompt_p50"] == 11_587 and s["output_p50"] == 69
    assert max(r.prompt_tokens for r in data) > 190_000
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // 512) for r in data)


@needs_traces
def test_mooncake_block_reuse_figures(mooncake):
    data, _ = mooncake
    assert mooncake_block_reuse(data) == pytest.approx(0.65, abs=0.01)
    assert block_repeat_fraction(data) == pytest.approx(0.64, abs=0.01)


def test_block_reuse_hand_example(tmp_path):
    rows, _ = _own_jsonl_rows(tmp_path)
    # row0 blocks [1,2] 600 tok (512 + 88); row1 [1,3] 700 tok: block 1 hit (512), 3 miss
    assert mooncake_block_reuse(rows[:2]) == pytest.approx(512 / 1300)


def _own_jsonl_rows(tmp_path):
    lines = [
        {"timestamp_s": 0.5, "prompt_tokens": 600, "output_tokens": 5, "hash_ids": [1, 2], "group": "a"},
        {"timestamp_s": 1.5, "prompt_tokens": 700, "output_tokens": 9, "hash_ids": [1, 3]},
        {"timestamp_s": 4.0, "prompt_tokens": 20, "output_tokens": 3, "prompt": "hello there"},
    ]
    path = tmp_path / "own.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return load_trace(path)


def test_own_jsonl_and_transforms(tmp_path):
    rows, info = _own_jsonl_rows(tmp_path)
    assert info.format == "jsonl"
    assert [r.timestamp_s for r in rows] == [0.0, 1.0, 3.5]  # rebased to the first row
    assert rows[0].group == "a" and rows[2].prompt == "hello there"
    fast = scale_time(rows, 2.0, info)
    assert [r.timestamp_s for r in fast] == [0.0, 0.5, 1.75] and info.time_scale == 2.0
    assert len(slice_rows(rows, first_n=2, info=info)) == 2 and info.rows_used == 2
    window = slice_rows(rows, start_s=0.5, end_s=4.0)
    assert [r.timestamp_s for r in window] == [0.0, 2.5]


def test_burstgpt_drops_failed(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,100,20,120,Conversation log\n6,GPT-4,50,0,50,Conversation log\n"
                    "9,ChatGPT,70,30,100,API log\n")
    rows, info = load_trace(path)
    assert info.format == "burstgpt"
    assert [(r.timestamp_s, r.prompt_tokens, r.output_tokens) for r in rows] == [(0.0, 100, 20), (4.0, 70, 30)]


def test_fit_to_context_clamp_and_scale(tmp_path):
    rows, info = _own_jsonl_rows(tmp_path)
    clamped = fit_to_context(rows, 650, "clamp")
    assert [(r.prompt_tokens, r.output_tokens) for r in clamped] == [(600, 5), (649, 1), (20, 3)]
    scaled = fit_to_context(rows, 2048, "scale", scale=0.25, info=info)
    assert [r.prompt_tokens for r in scaled] == [150, 175, 5]
    assert info.block_size == 128 and info.length_mode == "scale" and info.num_clamped == 0


def test_trace_workload_keeps_prefix_structure(tmp_path):
    rows, _ = _own_jsonl_rows(tmp_path)
    builder = PromptBuilder(WordTokenizer())
    scaled = fit_to_context(rows, 4096, "scale", scale=0.25)
    specs = trace_workload(scaled, builder, np.random.default_rng(0), block_size=128)
    a, b = specs[0].prompt_token_ids, specs[1].prompt_token_ids
    assert len(a) == 150 and len(b) == 175
    assert a[:128] == b[:128]  # shared hash id 1 -> same tokens
    assert a[128:150] != b[128:150]  # ids 2 vs 3 differ
    assert specs[2].prompt == "hello there" and specs[0].max_tokens == 5
    text_specs = trace_workload(scaled[:2], builder, np.random.default_rng(0), block_size=128, as_token_ids=False)
    assert [len(builder.encode(s.prompt)) for s in text_specs] == [150, 175]
