"""Shared test set-up.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, so it is set
here, at import time of the test session, whenever no CUDA GPU is present.
"""

from __future__ import annotations

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two cores on CI: keep torch from oversubscribing when tests spawn helper processes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (scripts/run_tests.sh), worker i of n runs on its own share of the CPUs,
    and so does every process it starts (affinity is inherited): torch's default thread count
    follows the affinity, so two workers do not each spread a thread pool over both cores of a
    2-core machine (each pool's barriers then wait on threads the other worker has descheduled).
    Nothing is pinned with more workers than CPUs, outside xdist, or with SERVELAB_TEST_PIN=0. A
    replacement worker (after a crash) takes the share of its number modulo n; its start never fails."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit() and hasattr(os, "sched_setaffinity")):
        return
    if os.environ.get("SERVELAB_TEST_PIN") == "0":
        return
    # a worker xdist starts in place of a crashed one is numbered past n (gw2 of 2): it takes a share too
    cpus, n = sorted(os.sched_getaffinity(0)), int(count)
    i = int(worker[2:]) % max(n, 1)
    if n > len(cpus):
        return
    share = len(cpus) // n
    os.sched_setaffinity(0, cpus[i * share : (i + 1) * share])


_pin_xdist_worker()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TRACES = SHARED / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.skip("no ../shared/traces (the real traces live beside the project)")
    return TRACES


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from engine.model.source import embedded_gguf_path

    return Path(embedded_gguf_path())
