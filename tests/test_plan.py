"""servelab-plan: tiny end-to-end runs on the simulator, and clear errors for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from workloads.plan import best_row
from workloads.plan_cli import main

# SmolLM2 on one H100, roofline: each run is a few hundred simulated steps.
TINY = ["--model", "smollm2", "--hardware", "h100", "--tp", "1", "--plain"]
SYNTH = ["--num-requests", "24", "--prompt-len", "96", "--output-len", "16"]


def test_grid_of_configs_and_rates_writes_csv_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan"
    rc = main([*TINY, *SYNTH, "--rates", "2,2000", "--max-num-batched-tokens", "64,512", "--max-num-seqs", "4",
               "--slo-ttft-ms", "50", "--slo-tpot-ms", "50", "--out", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT p99" in text and "best: max_num_batched_tokens=" in text
    df = pd.read_csv(out / "plan.csv")
    assert len(df) == 4 and set(df["max_num_batched_tokens"]) == {64, 512} and set(df["rate"]) == {2, 2000}
    assert (df["completed"] == 24).all()
    assert df["mean_kv_usage"].between(0, 1).all() and (df["max_kv_usage"] > 0).all()
    # Light load meets a loose SLO; 2000 req/s with 4 sequences queues far beyond 50 ms.
    light = df[df["rate"] == 2]
    assert light["meets_slo"].all() and not df[df["rate"] == 2000]["meets_slo"].any()
    assert (light["request_goodput"] > 0).all()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["best"]["rate"] == 2 and plan["slo"]["max"] == {"p99_ttft_ms": 50.0, "p99_tpot_ms": 50.0}


def test_search_finds_the_knee_and_replicas(tmp_path, capsys) -> None:
    args = [*TINY, *SYNTH, "--search", "--search-start", "4", "--search-tol", "0.5", "--slo-ttft-ms", "100",
            "--slo-stat", "mean", "--max-num-seqs", "8", "--target-rate", "1000", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    (search,) = plan["searches"]
    rates = {rate: ok for rate, ok in search["curve"]}
    knee = search["max_rate"]
    assert rates[knee] and knee >= 4  # the knee passed, every higher evaluated rate failed
    assert all(not ok for rate, ok in rates.items() if rate > knee)
    assert plan["best"]["rate"] == knee and plan["replicas"] == -(-1000 // knee)
    assert (
        f"{plan['replicas']} replica(s) of the best configuration serve 1000 req/s" in capsys.readouterr().out
    )
    assert "<svg" in (tmp_path / "plan.html").read_text()


def test_trace_with_time_scales(traces_dir, tmp_path, capsys) -> None:
    trace = traces_dir / "AzureLLMInferenceTrace_conv.csv"
    out = tmp_path / "p"
    assert (
        main([*TINY, "--trace", str(trace), "--first-n", "20", "--time-scales", "1,4", "--out", str(out)])
        == 0
    )
    df = pd.read_csv(out / "plan.csv")
    assert list(df["time_scale"]) == pytest.approx([1.0, 4.0])
    assert df["rate"].iloc[1] == pytest.approx(4 * df["rate"].iloc[0])
    assert (df["completed"] == 20).all()
    assert "best:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "no-such-model", "--rates", "1"], "no model config 'no-such-model'"),
        (["--hardware", "tpu9", "--rates", "1"], "no hardware profile 'tpu9'"),
        (["--trace", "/no/such/trace.csv", "--rates", "1"], "trace not found"),
        (
            ["--rates", "1", "--search", "--slo-ttft-ms", "1"],
            "exactly one of plan.rates, plan.time_scales, plan.search=true",
        ),
        (["--rates", "fast"], "--rates: expected comma-separated float"),
        (["--rates", "1", "--max-num-seqs", "0"], "--max-num-seqs: values must be > 0"),
        (["--search"], "plan.search needs an SLO"),
        (["--time-scales", "2"], "plan.time_scales (--time-scales) needs a trace"),
        (
            ["--model", "llama-3-70b", "--hardware", "a100", "--tp", "1", "--rates", "1"],
            "no room for a KV cache",
        ),
        (["--model", "llama-3-70b", "--tp", "3", "--rates", "1"], "tp=3"),
        (["--prompt-len", "9000", "--rates", "1"], "exceed the context"),
    ],
)
def test_bad_input_is_one_line_no_traceback(argv: list[str], message: str, capsys) -> None:
    base = ["--plain", "--num-requests", "2", "--prompt-len", "8", "--output-len", "2"]
    assert main(["--model", "smollm2", "--hardware", "h100", *base, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


SEARCH = ["--search", "--slo-ttft-ms", "100"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--search-start", "50", "--search-max", "10"],
            "plan.search_start 50 req/s is above plan.search_max 10 req/s",
        ),
        (["--search-start", "0"], "plan.search_start (--search-start) must be a finite rate > 0"),
        (["--search-start", "-2"], "plan.search_start (--search-start) must be a finite rate > 0"),
        (["--search-start", "inf"], "plan.search_start (--search-start) must be a finite rate > 0"),
        (["--search-max", "0"], "plan.search_max (--search-max) must be a finite rate > 0"),
        (["--search-max", "nan"], "plan.search_max (--search-max) must be a finite rate > 0"),
        (["--search-tol", "0"], "plan.search_tol (--search-tol) must be a number > 0"),
        # No --search-start: a synthetic search starts at 1 req/s, above this limit.
        (
            ["--search-max", "0.5"],
            "the default start, 1 req/s (where the search starts by default), is above",
        ),
    ],
)
def test_search_bounds_are_validated(argv: list[str], message: str, capsys) -> None:
    assert main([*TINY, *SYNTH, *SEARCH, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("servelab-plan: error: ") and message in err and "Traceback" not in err
    assert "meets SLOs" not in err and "violates" not in err  # rejected before any simulated run


def test_search_from_the_trace_rate_checks_it_against_the_limit(traces_dir, capsys) -> None:
    trace = ["--trace", str(traces_dir / "AzureLLMInferenceTrace_conv.csv"), "--first-n", "20"]
    assert main([*TINY, *trace, *SEARCH, "--search-max", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "the trace's own rate" in err and "is above plan.search_max 0.001 req/s" in err
    assert "give plan.search_start <= 0.001" in err and "Traceback" not in err


def test_search_stays_within_the_limit(tmp_path) -> None:
    # Every rate meets this SLO: the search doubles from 4 and stops at the limit, 10, not beyond.
    args = [*TINY, *SYNTH, "--search", "--search-start", "4", "--search-max", "10", "--slo-ttft-ms", "1e9",
            "--max-num-seqs", "8", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    (search,) = json.loads((tmp_path / "plan.json").read_text())["searches"]
    assert [rate for rate, _ in search["curve"]] == [4, 8, 10] and search["max_rate"] == 10


def test_argparse_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--tp", "eight"])
    assert e.value.code == 2 and "invalid int value" in capsys.readouterr().err


def test_best_row_prefers_rate_then_goodput() -> None:
    rows = [
        {"rate": 1.0, "meets_slo": True, "request_goodput": 1.0, "output_throughput": 10.0},
        {"rate": 2.0, "meets_slo": True, "request_goodput": 1.5, "output_throughput": 20.0},
        {"rate": 2.0, "meets_slo": True, "request_goodput": 1.9, "output_throughput": 19.0},
        {"rate": 4.0, "meets_slo": False, "request_goodput": 0.5, "output_throughput": 30.0},
    ]
    assert best_row(rows) is rows[2]
    assert best_row([rows[3]]) is None


def test_hydra_overrides_plan_the_same_as_the_old_flags(tmp_path) -> None:
    flags = ["--model", "smollm2", "--hardware", "h100", "--plain", "--num-requests", "6", "--prompt-len", "16",
             "--output-len", "4", "--rates", "2,50", "--max-num-seqs", "2,4", "--out", str(tmp_path / "a")]
    overrides = ["model=smollm2", "sim.hardware=h100", "plan.plain=true", "workload.num_requests=6",
                 "workload.prompt_len.value=16", "workload.output_len.value=4", "plan.rates=[2,50]",
                 "plan.max_num_seqs=[2,4]", f"plan.out={tmp_path / 'b'}"]  # fmt: skip
    assert main(flags) == 0 and main(overrides) == 0

    def rows(folder: str) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_s"}
                for r in json.loads((tmp_path / folder / "plan.json").read_text())["rows"]]  # fmt: skip

    assert len(rows("a")) == 4 and rows("a") == rows("b")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan.ratez=[1]"], "unknown key 'plan.ratez': plan (PlanSection) has max_num_batched_tokens"),
        (["model=llama3", "plan.rates=[1]"], "unknown model 'llama3' (known: gemma-3-27b, gemma3-270m, llama-3-70b"),
        (["model=smollm2", "workload=default", "plan.rates=[1]"], "workload.prompt_len.dist: the planner's synthetic traffic"),
    ],
)
def test_unknown_keys_fail_in_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("servelab-plan: error: ") and message in err and err.count("\n") == 1


def test_table_without_rich_falls_back_to_plain_text() -> None:
    """The default (rich) table must not fail where rich cannot be imported (issue 13, defect 9)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'rich' or name.startswith('rich.'):\n"
        "            raise ImportError('rich blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from workloads.plan_output import render\n"
        "from workloads.plan_output import COLUMNS\n"
        "row = {c: 1.0 for c in COLUMNS}\n"
        "row.update(max_num_batched_tokens=256, max_num_seqs=8, num_preemptions=0, meets_slo=True)\n"
        "render([row], row, plain=False)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "best: max_num_batched_tokens=256" in out.stdout


def test_verify_runs_the_best_picks_on_the_target_and_reports_the_error(tmp_path, capsys) -> None:
    """plan.verify=2 on the simulated target (the real-engine runs take minutes; the wiring is the
    same): the run replays the very requests the planner simulated (pickN_arrivals.jsonl, token-id
    prompts, the same arrival times) on the same model and hardware, so every figure agrees exactly
    (before, the run drew its own Poisson arrivals: output throughput was off by 17%)."""
    out = tmp_path / "plan"
    argv = ["model=smollm2", "sim.hardware=h100", "plan.plain=true", "workload.num_requests=24",
            "workload.prompt_len.value=96", "workload.output_len.value=16", "plan.rates=[2,4,2000]",
            "plan.max_num_batched_tokens=[64,512]", "plan.max_num_seqs=[4]", "slo.ttft_ms=50", "slo.tpot_ms=50",
            "plan.verify=2", "target.kind=simulated", "run.time_reference=false", "report.html=false",
            f"plan.out={out}"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "verify budget" in text and "measured" in text
    assert re.search(r"load average [\d.]+ -> [\d.]+ on \d+ cores", text)  # a shared host says so
    plan = json.loads((out / "plan.json").read_text())
    results = plan["verify"]
    assert len(results) == 2 and all(not r["error"] for r in results)
    assert all(set(r["load_average"]) == {"before", "after", "cores"} for r in results)
    # the two best picks: the highest rate meeting the SLOs, for each budget
    assert {(r["max_num_batched_tokens"], r["rate"]) for r in results} == {(64, 4), (512, 4)}
    for r in results:
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["completed"] == 24
        for m in ("mean_ttft_ms", "mean_tpot_ms", "output_throughput"):
            assert r["measured"][m] == summary[m]
            assert r["relative_error"][m] == pytest.approx((r["simulated"][m] - r["measured"][m]) / r["measured"][m])
        assert all(abs(e) < 1e-6 for e in r["relative_error"].values()), r
    arrivals = [json.loads(line) for line in (out / "verify" / "pick0_arrivals.jsonl").read_text().splitlines()]
    assert len(arrivals) == 24 and {(a["prompt_tokens"], a["output_tokens"]) for a in arrivals} == {(96, 16)}
    assert all(b["timestamp_s"] > a["timestamp_s"] for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert "<h2>Verified picks</h2>" in (out / "plan.html").read_text()
