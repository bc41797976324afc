"""The engine stands alone: importable and usable with the workbench's `conf` package unimportable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import importlib.abc
import sys


class BlockConf(importlib.abc.MetaPathFinder):
    """Any import of `conf` (or below it) fails, as in an install without the workbench."""

    def find_spec(self, name, path=None, target=None):
        if name == "conf" or name.startswith("conf."):
            raise ImportError(f"blocked: {name}")
        return None


sys.meta_path.insert(0, BlockConf())
try:
    import conf  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block conf")

from engine.frontend.llm import LLM
from engine.model.loader import resolve_model
from engine.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.sim.hardware import HardwareProfile
from engine.sim.model_counts import load_arch

llm = LLM(model="smollm2", max_model_len=64, num_gpu_blocks_override=16)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))
assert len(out[0].outputs[0].token_ids) == 4, out
assert load_arch("llama-3-70b").num_layers == 80
assert HardwareProfile.load("h200").memory_gb == 141
arch, weights, _ = resolve_model(ModelConfig(model="mixtral-8x7b", num_layers_override=1))
assert weights is None and arch.is_moe
assert not any(name == "conf" or name.startswith("conf.") for name in sys.modules)
print("generated", out[0].outputs[0].token_ids)
'''


def test_engine_runs_without_conf() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated [" in proc.stdout


def test_engine_sources_never_import_conf() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "engine").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.lstrip().startswith(("import conf", "from conf"))
    ]
    assert offenders == []
