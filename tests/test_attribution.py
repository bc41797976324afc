"""SLO misses attributed to causes (issue 16, item 2), on simulated runs built to miss one way.

The simulated executor prices each step with a known step model, so the runs are fast and
the causes are designed in: a rate far above capacity must miss TTFT by queueing; long
prompts arriving while requests decode, under a large token budget, must miss TPOT by
prefill interference. Acceptance: >= 80% of the misses carry the designed cause.
"""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.attribution import DecodeLine, attribute, attribution_frame, fit_decode_line, miss_summary
from analysis.record import RequestRecord
from engine.config import EngineConfig
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from workloads.simulate import simulate
from workloads.spec import RequestSpec

ARCH = ModelArch(8, 2, 4, 2, 2, 16, vocab_size=64, eos_token_id=8, max_position_embeddings=8192)
# 10 ms a step + 0.05 ms a prefill token + 1 ms a decoding request.
STEP_MODEL = {"num_prefill_tokens": 5e-5, "num_decode_reqs": 1e-3}


def _run(specs: list[RequestSpec], slo: dict[str, float | None], budget: int, seqs: int):  # noqa: ANN202
    cfg = EngineConfig()
    cfg.cache.num_blocks = 4096
    cfg.scheduler.max_num_batched_tokens = budget
    cfg.scheduler.max_num_seqs = seqs
    ex = SimulatedExecutor(cfg, CalibratedStepModel(0.010, dict(STEP_MODEL)), ARCH)
    res = simulate(specs, cfg, ex, slo=slo)
    return res.records, res.steps_frame(), res.summary()


def _spec(rid: str, arrival: float, prompt: int, out: int) -> RequestSpec:
    """Prompts differ from their first token on (no prefix-cache hits between requests)."""
    salt = sum(map(ord, rid))
    return RequestSpec(rid, arrival, None, [10 + (i * 7 + salt) % 50 for i in range(prompt)], prompt, out)


def test_rate_above_capacity_misses_ttft_by_queueing() -> None:
    specs = [_spec(f"r{i}", 0.02 * i, 64, 16) for i in range(60)]  # 50 req/s against ~12 req/s
    slo = {"ttft_ms": 200.0, "tpot_ms": None, "e2el_ms": None}
    records, steps, summary = _run(specs, slo, budget=2048, seqs=4)
    found = attribute(records, steps, slo)
    ttft_misses = [a for a in found if "ttft" in a.causes]
    assert len(ttft_misses) >= 30
    share = sum(a.causes["ttft"] == "queueing" for a in ttft_misses) / len(ttft_misses)
    assert share >= 0.8, attribution_frame(found)["cause_ttft"].value_counts().to_dict()
    assert summary["slo_misses"]["ttft"] == len(ttft_misses)
    assert summary["slo_miss_causes"]["ttft"]["queueing"] >= 0.8 * len(ttft_misses)


def test_long_prompts_during_decodes_miss_tpot_by_prefill_interference() -> None:
    decoders = [_spec(f"d{i}", 0.0, 16, 300) for i in range(4)]
    long_prompts = [_spec(f"p{i}", 0.1 + 0.2 * i, 4000, 2) for i in range(25)]
    slo = {"ttft_ms": None, "tpot_ms": 20.0, "e2el_ms": None}
    records, steps, _ = _run(decoders + long_prompts, slo, budget=8192, seqs=32)
    found = attribute(records, steps, slo)
    tpot = [a for a in found if "tpot" in a.causes]
    assert {a.request_id for a in tpot} >= {"d0", "d1", "d2", "d3"}
    share = sum(a.causes["tpot"] == "prefill_interference" for a in tpot) / len(tpot)
    assert share >= 0.8, attribution_frame(found)[["request_id", "cause_tpot"]].to_dict("records")


def test_decode_line_fit_and_components_by_hand() -> None:
    steps = pd.DataFrame({
        "time": [0.1, 0.2, 0.3, 0.4, 0.5], "step_time": [0.011, 0.013, 0.015, 0.115, 0.013],
        "num_prefill_tokens": [0, 0, 0, 2000, 0], "num_decode_tokens": [1, 3, 5, 3, 3],
        "num_decode_reqs": [1, 3, 5, 3, 3], "num_preemptions": [0, 0, 0, 0, 0],
    })  # fmt: skip
    line = fit_decode_line(steps)
    assert line is not None and line.a == pytest.approx(0.010) and line.c == pytest.approx(0.001)
    rec = RequestRecord("x", scheduled_s=0.0, start_s=0.0, token_times=[0.15, 0.2, 0.3, 0.4, 0.5],
                        prompt_tokens=8, output_tokens=5, server_queued_s=0.05, server_prefill_s=0.1,
                        server_decode_s=0.35)  # fmt: skip
    (a,) = attribute([rec], steps, {"tpot_ms": 50.0, "ttft_ms": 100.0, "e2el_ms": None})
    # Decode window (0.15, 0.5]: steps at 0.2..0.5; the 0.4 step ran 2000 prefill tokens: 115 - 13 ms.
    assert a.decode_ms["prefill_interference"] == pytest.approx(102.0)
    assert a.decode_ms["batch_size"] == pytest.approx(2.0 + 4.0 + 2.0 + 2.0)
    assert a.causes == {"ttft": "prefill", "tpot": "prefill_interference"}
    assert DecodeLine(0.01, 0.001).at(0) == pytest.approx(0.011)
    assert miss_summary([a])["slo_miss_causes"]["tpot"] == {"prefill_interference": 1}


def test_without_engine_timings_or_steps_the_cause_is_unknown_or_harness() -> None:
    rec = RequestRecord("x", scheduled_s=0.0, start_s=0.0, token_times=[1.0, 1.1], prompt_tokens=4, output_tokens=2)
    (a,) = attribute([rec], None, {"ttft_ms": 100.0, "tpot_ms": None, "e2el_ms": None})
    assert a.causes == {"ttft": "unknown"}
    late = RequestRecord("y", scheduled_s=0.0, start_s=0.5, token_times=[1.0, 1.1], prompt_tokens=4,
                         output_tokens=2, lateness_s=0.5)  # fmt: skip
    (b,) = attribute([late], None, {"ttft_ms": 100.0, "tpot_ms": None, "e2el_ms": None})
    assert b.causes == {"ttft": "harness_lateness"}


def test_report_section_names_the_causes_and_draws_the_worst(tmp_path) -> None:  # noqa: ANN001
    import re

    import yaml

    from analysis import runfolder
    from reports.run_report import build_report

    decoders = [_spec(f"d{i}", 0.0, 16, 120) for i in range(3)]
    long_prompts = [_spec(f"p{i}", 0.1 + 0.2 * i, 4000, 2) for i in range(8)]
    slo = {"ttft_ms": None, "tpot_ms": 20.0, "e2el_ms": None}
    records, steps, summary = _run(decoders + long_prompts, slo, budget=8192, seqs=32)
    runfolder.write_requests(tmp_path, records)
    runfolder.write_steps(tmp_path, steps)
    runfolder.write_summary(tmp_path, summary)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"slo": slo}))
    html = build_report(tmp_path).read_text()
    section = re.search(r'<section id="slo-misses".*?</section>', html, re.S)
    assert section is not None and 'class="missing"' not in section.group(0)
    assert "prefill_interference" in section.group(0) and "data:image/png;base64" in section.group(0)
