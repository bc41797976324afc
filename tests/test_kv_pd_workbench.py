"""`servelab-run target=pd workload=shared_prefix` end to end (issue 15): the workbench starts a
Mooncake master, a prefill and a decode servelab-serve and the router, drives the router with
the shared-prefix workload, and writes a run folder whose report has the connector figures;
with Mooncake's store between the instances (`target.kv_connector=store`) and with its
TransferEngine reading the prefill instance's outbox directly (`transfer`).

Real SmolLM2 weights and real processes, a short workload: 6 requests of 300-340 prompt tokens
over 2 shared 256-token prefixes (16 full blocks each, saved by the prefill instance and
loaded by the decode instance), 4 output tokens. Needs Mooncake as tests/test_kv_mooncake.py does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_kv_mooncake import _mooncake_missing

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))]

WORKLOAD = ["workload=shared_prefix", "workload.num_requests=6", "workload.warmup_requests=0",
            "workload.prompt_len.low=300", "workload.prompt_len.high=340", "workload.output_len.value=4",
            "workload.shared_prefix.num_groups=2", "workload.shared_prefix.fraction=1.0",
            "workload.arrival.rate=8.0", "workload.prompt_as_token_ids=true",
            "cache.num_blocks=256", "scheduler.max_num_seqs=8", "model.num_layers_override=8", "run.time_reference=false",
            "profiling.telemetry=false",
            "model.warm_up_linears=false"]  # oneDNN's kernels built as steps need them: nothing here is timed


def test_servelab_run_target_pd_writes_a_run_folder_with_connector_figures(tmp_path: Path) -> None:
    """Both connectors, their runs started together (each mostly waits on its servers' start-up;
    nothing here is timed)."""
    runs = {connector: tmp_path / connector for connector in ("store", "transfer")}
    procs = {connector: subprocess.Popen([sys.executable, "-m", "workloads.cli", "target=pd",
                                          f"target.kv_connector={connector}", *WORKLOAD, f"hydra.run.dir={run}"],
                                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for connector, run in runs.items()}  # fmt: skip
    for connector, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (connector, out[-3000:] + err[-3000:])
    for connector, run in runs.items():
        _check_run_folder(run, connector)


def _check_run_folder(run: Path, connector: str) -> None:
    assert not (run / "error.txt").exists(), connector
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 24, connector
    # TTFT (the prefill instance's first token, through the router) and TPOT (the decode
    # instance's tokens) recorded separately, per request
    df = pd.read_csv(run / "requests.csv")
    assert df["ttft_ms"].notna().all() and (df["ttft_ms"] > 0).all(), connector
    assert df["tpot_ms"].notna().all() and (df["tpot_ms"] > 0).all(), connector
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0, connector
    # each instance's connector counters, by role: the prefill side saved, the decode side loaded
    instances = {row["role"]: row for row in summary["kv_connector_instances"]}
    assert set(instances) == {"prefill", "decode"}, connector
    assert instances["prefill"]["saved_blocks"] >= 2 * 16, connector  # both shared prefixes' full blocks at least
    assert instances["decode"]["loaded_blocks"] > 0 and instances["decode"]["external_hit_tokens"] > 0, connector
    assert instances["decode"]["load_failures"] == 0, connector
    page = (run / "report.html").read_text()
    assert "External KV (connector)" in page and "prefill0" in page and "decode1" in page, connector
    # every server the target started is gone (their command lines name configs in the run folder)
    left = [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
            if str(run) in line]
    assert not left, (connector, left)
