"""SLO attribution from a request's own steps, on hand-built steps and members (issue 37, item 4),
and the members the engine records (the simulated executor: the real scheduler, priced steps).

Each by-hand case is one of the old attribution's faults: prefix-hit tokens counted as the
request's own prefill, harness lateness competing for TPOT, batch size winning TPOT at any load,
and preemption counted over every step of the window instead of the request's time out.
"""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.attribution import attribute
from analysis.record import RequestRecord
from analysis.step_members import members_frame, read_members, write_members
from engine.config import EngineConfig
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor
from workloads.simulate import simulate
from workloads.spec import RequestSpec

STEP_COLUMNS = ["step", "time", "step_time", "num_prefill_tokens", "num_decode_tokens", "num_decode_reqs",
                "num_preemptions"]  # fmt: skip


def _frames(steps: list[tuple], members: list[tuple]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """steps: (step, end time, step time); members: (step, request, tokens, kind, computed, hit)."""
    m = pd.DataFrame(members, columns=["step", "request_id", "num_tokens", "kind", "num_computed", "num_prefix_hit"])
    rows = []
    for step, end, dt in steps:
        mine = m[m["step"] == step]
        pf = mine[mine["kind"] != "decode"]["num_tokens"].sum()
        dec = int((mine["kind"] == "decode").sum())
        rows.append((step, end, dt, pf, dec, dec, 0))
    return pd.DataFrame(rows, columns=STEP_COLUMNS), m


def _record(rid: str, start: float, times: list[float], prompt: int, **kw) -> RequestRecord:  # noqa: ANN003
    return RequestRecord(rid, scheduled_s=start, start_s=start, token_times=times, prompt_tokens=prompt,
                         output_tokens=len(times), **kw)  # fmt: skip


def test_prefix_hits_are_nobodys_prefill() -> None:
    # b's 100-token prompt hit 80 in the cache: it scheduled 20 beside a's 20 in one 40 ms step.
    steps, members = _frames([(0, 0.04, 0.04)], [(0, "a", 20, "prefill", 0, 0), (0, "b", 20, "prefill", 80, 80)])
    b = _record("b", 0.0, [0.04], 100, server_queued_s=0.0, server_prefill_s=0.04, server_ttft_s=0.04)
    (att,) = attribute([b], steps, {"ttft_ms": 10.0}, members)
    assert att.ttft_ms["prefill_interference"] == pytest.approx(20.0)  # 40 ms x 20 / 40 tokens
    assert att.ttft_ms["prefill"] == pytest.approx(20.0)
    # the old windows counted the 100 prompt tokens as b's own: 1 - 100/40 < 0, no interference
    (old,) = attribute([b], steps, {"ttft_ms": 10.0}, None)
    assert old.ttft_ms["prefill_interference"] == 0.0


def test_harness_lateness_never_explains_tpot() -> None:
    steps, members = _frames([(i, 0.01 * (i + 1), 0.01) for i in range(5)],
                             [(0, "x", 8, "prefill", 0, 0), *[(i, "x", 1, "decode", 7 + i, 0) for i in range(1, 5)]])
    x = _record("x", 1.0, [1.01, 1.02, 1.03, 1.04, 1.05], 8, lateness_s=2.0, server_queued_s=0.0,
                server_ttft_s=0.01, server_decode_s=0.04)  # fmt: skip
    (att,) = attribute([x], steps, {"tpot_ms": 5.0}, members)
    assert att.causes["tpot"] == "decode"  # its own decode alone exceeds 5 ms per token
    (old,) = attribute([x], steps, {"tpot_ms": 5.0}, None)
    assert old.causes["tpot"] != "harness_lateness"


def test_batch_size_is_no_cause_when_the_batch_never_varied() -> None:
    # four requests decode together in every step: each pays the batch, none is slowed by others
    rids = ["a", "b", "c", "d"]
    mem = [(0, r, 4, "prefill", 0, 0) for r in rids]
    mem += [(s, r, 1, "decode", 3 + s, 0) for s in range(1, 6) for r in rids]
    steps, members = _frames([(s, 0.02 * (s + 1), 0.02) for s in range(6)], mem)
    recs = [_record(r, 0.0, [0.02 * (s + 1) for s in range(6)], 4, server_queued_s=0.0, server_ttft_s=0.02,
                    server_decode_s=0.1) for r in rids]  # fmt: skip
    found = attribute(recs, steps, {"tpot_ms": 1.0, "e2el_ms": 1.0}, members)
    assert {a.causes["tpot"] for a in found} == {"decode"}
    assert {a.causes["e2el"] for a in found} != {"batch_size"}


def test_preemption_is_the_requests_time_out_plus_its_recompute() -> None:
    # y decodes in steps 1-2, is preempted, sits out steps 3-6 (x runs alone), recomputes in 7.
    mem = [(0, "x", 8, "prefill", 0, 0), (0, "y", 8, "prefill", 0, 0)]
    mem += [(s, r, 1, "decode", 7 + s, 0) for s in (1, 2) for r in ("x", "y")]
    mem += [(s, "x", 1, "decode", 7 + s, 0) for s in range(3, 8)]
    mem += [(7, "y", 11, "recompute", 0, 0), (8, "y", 1, "decode", 11, 0)]
    steps, members = _frames([(s, 0.01 * (s + 1), 0.01) for s in range(9)], mem)
    y = _record("y", 0.0, [0.01, 0.02, 0.03, 0.08, 0.09], 8, server_queued_s=0.0, server_ttft_s=0.01,
                server_decode_s=0.08)  # fmt: skip
    x = _record("x", 0.0, [0.01 * (s + 1) for s in range(8)], 8, server_queued_s=0.0, server_ttft_s=0.01,
                server_decode_s=0.07)  # fmt: skip
    # 9 ms per token: above either one's own decode (x 8.7, y 7.5), so each misses by what it paid
    found = {a.request_id: a for a in attribute([x, y], steps, {"tpot_ms": 9.0}, members)}
    # out from the end of step 2 (0.03) to the start of step 7 (0.07), plus step 7 itself
    assert found["y"].decode_ms["preemption"] == pytest.approx(50.0)
    assert found["y"].causes["tpot"] == "preemption"
    assert "preemption" not in found["x"].decode_ms  # x's window saw it, x never left the batch
    assert found["x"].causes["tpot"] == "prefill_interference"  # y's recompute in x's step 7


ARCH = ModelArch(8, 2, 4, 2, 2, 16, vocab_size=64, eos_token_id=8, max_position_embeddings=8192)


def test_the_engine_records_each_steps_members(tmp_path) -> None:  # noqa: ANN001
    """Simulated run, 16 KV blocks of 16 tokens for four 48+64-token requests (two share a prefix):
    the members name prefill, decode and recompute, and the shared prefix as a hit."""
    cfg = EngineConfig()
    cfg.cache.num_blocks, cfg.cache.enable_prefix_caching = 16, True
    ex = SimulatedExecutor(cfg, CalibratedStepModel(0.01, {"num_prefill_tokens": 1e-5, "num_decode_reqs": 1e-3}), ARCH)
    shared = [11 + i % 40 for i in range(32)]
    prompts = {"a": shared + [5] * 16, "b": [20 + i % 30 for i in range(48)], "c": [30 + i % 20 for i in range(48)],
               "d": shared + [6] * 16}  # fmt: skip
    specs = [RequestSpec(rid, 0.05 * i, None, p, len(p), 64) for i, (rid, p) in enumerate(prompts.items())]
    res = simulate(specs, cfg, ex)
    members = members_frame(res.steps)
    assert set(members["kind"]) == {"prefill", "decode", "recompute"}
    per_req = members.groupby("request_id")
    for _rid, rows in per_req:
        first = rows.sort_values("step").iloc[0]
        assert first["kind"] == "prefill" and first["num_computed"] == first["num_prefix_hit"]
        assert int((rows["kind"] == "decode").sum()) <= 63
    assert int(per_req.get_group("d").sort_values("step").iloc[0]["num_prefix_hit"]) == 32
    steps = res.steps_frame()
    assert "members" not in steps.columns
    tokens = members.groupby("step")["num_tokens"].sum()
    on_steps = steps.set_index("step")["num_prefill_tokens"] + steps.set_index("step")["num_decode_tokens"]
    assert (tokens == on_steps.loc[tokens.index]).all()
    write_members(tmp_path, members)
    back = read_members(tmp_path)
    assert back is not None and back.equals(members)
