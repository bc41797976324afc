"""Peer engines as targets: `target=vllm` starts vLLM's OpenAI server from a configured venv.

The harness starts `<venv>/bin/python -m vllm.entrypoints.openai.api_server` on the same model
converted to an HF folder (scripts/peers.sh makes both), on a free local port, with this run's
scheduler limits (max_num_seqs, max_num_batched_tokens), context length and dtype; waits for
`/health`; drives it like any OpenAI server (chunk timing: vLLM has no servelab timing
extension) while scraping its `/metrics`; and stops it. Before anything starts, the venv is
checked: no python there, or no `vllm` package it can import, is one clear line.

vLLM's CPU build reads its settings from the environment (`VLLM_CPU_KVCACHE_SPACE` in GB,
`VLLM_CPU_NUM_OF_RESERVED_CPU`); `target.peer_env` adds to or overrides them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from workloads.targets.engine import ServerTarget

PEERS = Path("~/.cache/servelab-peers")
DEFAULT_VENV = PEERS / "vllm"
DEFAULT_HF_MODEL = PEERS / "smollm2-hf"
SERVED_NAME = "servelab-peer"
_VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class PeerMissingError(RuntimeError):
    """The configured peer is not installed; the message is one line for the user."""


def check_vllm(venv: Path, hf_model: Path) -> Path:
    """The venv's python, or PeerMissingError saying what is missing."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise PeerMissingError(f"target=vllm: no Python at {python} (vLLM is not installed there; "
                               "scripts/peers.sh makes the side venv, or set target.venv)")
    probe = subprocess.run([str(python), "-c", "import importlib.util as u, sys; "
                            "sys.exit(0 if u.find_spec('vllm') else 3)"],
                           capture_output=True, text=True, timeout=60, env=_clean_env())
    if probe.returncode != 0:
        raise PeerMissingError(f"target=vllm: vLLM is not installed in {venv} (its python cannot find "
                               "the vllm package; scripts/peers.sh installs it, or set target.venv)")
    if not (hf_model / "config.json").is_file():
        raise PeerMissingError(f"target=vllm: no HF model folder at {hf_model} (config.json missing; "
                               "scripts/peers.sh converts the model, or set target.hf_model)")
    return python


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


class VLLMTarget(ServerTarget):
    """vLLM's OpenAI server, started and stopped by the harness (module doc)."""

    name = "vllm"
    label = "vLLM"

    def __init__(
        self, venv: str | None, hf_model: str | None, *, max_num_seqs: int, max_num_batched_tokens: int,
        max_model_len: int, dtype: str, extra_args: list[str] | None = None, extra_env: dict[str, Any] | None = None,
        startup_timeout_s: float = 600.0, log_path: str | None = None, endpoint: str = "completions",
        timeout_s: float | None = None,
    ) -> None:
        self.venv = Path(venv or DEFAULT_VENV).expanduser()
        self.hf_model = Path(hf_model or DEFAULT_HF_MODEL).expanduser()
        self.python = check_vllm(self.venv, self.hf_model)
        super().__init__("", startup_timeout_s, log_path, endpoint=endpoint, timeout_s=timeout_s,
                         server_timing=False)
        self.args = ["--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
                     "--max-model-len", str(max_model_len), "--dtype", _VLLM_DTYPES.get(dtype, "auto"),
                     "--seed", "0", *(extra_args or [])]
        self.extra_env = {k: str(v) for k, v in (extra_env or {}).items()}

    def command(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.hf_model),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def environment(self) -> dict[str, str]:
        env = _clean_env()
        env |= {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"}
        return env | self.extra_env
