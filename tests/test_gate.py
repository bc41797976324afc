"""servelab-gate: baselines, exact and reference-normalised metrics, repeats, exit codes."""

from __future__ import annotations

import json

from report_fixtures import make_run

from reports.gate import check, load_gate_config, make_baseline
from workloads.gate_cli import gate_main


def test_same_run_passes_and_writes_verdict(tmp_path, capsys):
    run = make_run(tmp_path / "a", profile=False, telemetry=False)
    base = tmp_path / "base.json"
    assert gate_main(["--make-baseline", str(base), str(run)]) == 0
    assert gate_main(["--baseline", str(base), str(run)]) == 0
    verdict = json.loads((run / "gate.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["checks"]
    assert "PASS" in capsys.readouterr().out


def test_slow_run_fails_with_one_line_per_metric(tmp_path, capsys):
    base_run = make_run(tmp_path / "a", profile=False, telemetry=False, time_reference_s=None)
    slow = make_run(tmp_path / "b", slow=1.6, profile=False, telemetry=False, time_reference_s=None)
    base = tmp_path / "base.json"
    gate_main(["--make-baseline", str(base), str(base_run)])
    assert gate_main(["--baseline", str(base), str(slow)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("REGRESSION mean_tpot_ms:"))
    assert "(+60%, tolerance 10%)" in line
    assert json.loads((slow / "gate.json").read_text())["verdict"] == "fail"


def test_time_metrics_compared_against_the_runs_reference(tmp_path):
    # Same workload on a machine 1.6x slower: raw times grow, ratios to the reference do not.
    config = load_gate_config()
    base = make_baseline(
        [make_run(tmp_path / "a", profile=False, telemetry=False)], tmp_path / "b.json", config
    )
    slow = json.loads(
        (make_run(tmp_path / "s", slow=1.6, profile=False, telemetry=False) / "summary.json").read_text()
    )
    checks = {c.metric: c for c in check(base, [slow], config)}
    assert checks["mean_tpot_ms"].normalised
    assert checks["mean_tpot_ms"].current > 1.5 * checks["mean_tpot_ms"].baseline
    # (throughput and step counts of the fixture also depend on the fixed arrival times)
    assert not any(
        checks[m].regressed for m in ("mean_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms")
    )


def test_exact_metrics_any_worsening_fails(tmp_path):
    config = load_gate_config()
    run = make_run(tmp_path / "a", profile=False, telemetry=False)
    base = make_baseline([run], tmp_path / "b.json", config)
    cur = json.loads((run / "summary.json").read_text())
    cur["num_preemptions"] += 1
    cur["prefix_cache_hit_rate"] *= 1.2  # better: fine
    regressed = [c.metric for c in check(base, [cur], config) if c.regressed]
    assert regressed == ["num_preemptions"]


def test_repeats_within_noise_do_not_fail(tmp_path):
    config = load_gate_config()
    config["metrics"] = {"mean_tpot_ms": {"direction": "lower", "tolerance": 0.02, "kind": "time"}}
    runs = [json.loads((make_run(tmp_path / f"r{i}", seed=i, profile=False, telemetry=False,
                                  time_reference_s=None) / "summary.json").read_text()) for i in range(6)]  # fmt: skip
    base = {"runs": [{"path": "x", "summary": s} for s in runs[:3]]}
    (c,) = check(base, runs[3:], config)
    assert c.ci is not None and c.ci[0] <= 0 <= c.ci[1]
    assert not c.regressed


def test_missing_inputs_exit_2(tmp_path, capsys):
    run = make_run(tmp_path / "a", profile=False, telemetry=False)
    assert gate_main(["--baseline", str(tmp_path / "none.json"), str(run)]) == 2
    assert gate_main(["--baseline", str(tmp_path / "none.json"), str(tmp_path / "no_run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("servelab-gate: error:") for e in err)


def test_a_different_kernel_choice_is_noted_beside_the_verdict(tmp_path, capsys):
    """summary.json's context (target, dtype, float32_linear) travels into the baseline; a run
    that ran other kernels gets a NOTE line and gate.json "notes", a run that did not gets none."""
    run = make_run(tmp_path / "a", profile=False, telemetry=False)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary | {"dtype": "float32", "float32_linear": "blas"}))
    base = tmp_path / "base.json"
    assert gate_main(["--make-baseline", str(base), str(run)]) == 0
    assert json.loads(base.read_text())["runs"][0]["summary"]["float32_linear"] == "blas"
    assert gate_main(["--baseline", str(base), str(run)]) == 0
    assert "NOTE" not in capsys.readouterr().out
    assert json.loads((run / "gate.json").read_text())["notes"] == []

    (run / "summary.json").write_text(json.dumps(summary | {"dtype": "float32", "float32_linear": "onednn-prepacked"}))
    gate_main(["--baseline", str(base), str(run)])
    note = "NOTE float32_linear: baseline blas, now onednn-prepacked (time metrics compare different configurations)"
    assert note in capsys.readouterr().out.splitlines()
    assert json.loads((run / "gate.json").read_text())["notes"] == [note]

    (run / "summary.json").write_text(json.dumps(summary | {"dtype": "bfloat16", "bfloat16_linear": "avx512_bf16"}))
    assert gate_main(["--make-baseline", str(base), str(run)]) == 0
    (run / "summary.json").write_text(json.dumps(summary | {"dtype": "bfloat16", "bfloat16_linear": "onednn"}))
    gate_main(["--baseline", str(base), str(run)])
    note = "NOTE bfloat16_linear: baseline avx512_bf16, now onednn (time metrics compare different configurations)"
    assert note in capsys.readouterr().out.splitlines()


def test_time_reference_runs_once_per_engine_core_at_the_same_time(monkeypatch):
    """The reference workload runs on `cores` threads together (so a core taken by other work
    slows it, as it slows the engine), each thread single-threaded; torch's threads are restored."""
    import threading

    import torch

    from workloads import time_reference

    seen: list[threading.Thread] = []  # the objects, not their idents: a finished thread's ident may be reused
    real_tanh = torch.tanh

    def tanh(a):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread())
        assert torch.get_num_threads() == 1
        return real_tanh(a)

    monkeypatch.setattr(torch, "tanh", tanh)
    threads = torch.get_num_threads()
    assert time_reference.measure_time_reference(repeats=2, iterations=3, cores=3) > 0
    assert len(seen) == 2 * 3 * 3 and len(set(seen[:9])) == 3
    assert torch.get_num_threads() == threads
