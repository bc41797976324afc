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
