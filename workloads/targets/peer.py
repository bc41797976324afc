"""Peer engines as targets: `target=vllm` starts vLLM's OpenAI server from a configured venv,
`target=llamacpp` llama-cpp-python's server (LlamaCppTarget below says how it differs).

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

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

from workloads.spec import RequestSpec
from workloads.targets.engine import ServerTarget

PEERS = Path("~/.cache/servelab-peers")
DEFAULT_VENV = PEERS / "vllm"
DEFAULT_HF_MODEL = PEERS / "smollm2-hf"
SERVED_NAME = "servelab-peer"
_VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class PeerMissingError(RuntimeError):
    """The configured peer is not installed; the message is one line for the user."""


def _venv_python(venv: Path, target: str, package: str, modules: tuple[str, ...], how: str) -> Path:
    """`venv`'s python if it can import `modules`, else PeerMissingError (one line naming `how`)."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise PeerMissingError(f"target={target}: no Python at {python} ({package} is not installed there; "
                               f"{how}, or set target.venv)")
    found = " and ".join(f"u.find_spec({m!r})" for m in modules)
    probe = subprocess.run([str(python), "-c", f"import importlib.util as u, sys; sys.exit(0 if {found} else 3)"],
                           capture_output=True, text=True, timeout=60, env=_clean_env())
    if probe.returncode != 0:
        raise PeerMissingError(f"target={target}: {package} is not installed in {venv} (its python cannot find "
                               f"{' and '.join(modules)}; {how.replace('makes the side venv', 'installs it')})")
    return python


def check_vllm(venv: Path, hf_model: Path) -> Path:
    """The venv's python, or PeerMissingError saying what is missing."""
    python = _venv_python(venv, "vllm", "vLLM", ("vllm",), "scripts/peers.sh makes the side venv")
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


# ---- llama.cpp (llama-cpp-python's OpenAI server) ---------------------------------------------
DEFAULT_LLAMACPP_VENV = PEERS / "llamacpp"


def check_llamacpp(venv: Path) -> Path:
    """The venv's python, or PeerMissingError saying what is missing."""
    return _venv_python(venv, "llamacpp", "llama-cpp-python[server]", ("llama_cpp", "uvicorn"),
                        "scripts/peers.sh --llamacpp-python (make peers-llamacpp-python) makes the side venv")


class LlamaCppTarget(ServerTarget):
    """llama-cpp-python's OpenAI server on the same GGUF file servelab loads (its own Q4_1
    kernels, not a conversion), started and stopped by the harness.

    What differs from the other servers, and how the target makes the requests equal:
    it has no `/health` (the harness waits for `/v1/models`) and no `/metrics` (reported once,
    not polled); it serves one request at a time (`interrupt_requests` off, so a new request
    waits instead of cutting the running stream); it samples with a repetition penalty unless
    told otherwise (`repeat_penalty: 1.0`); it has no `ignore_eos` (the EOS logit gets a bias
    of -100 instead); its completions take text prompts only.
    """

    name = "llamacpp"
    label = "llama.cpp"
    health_path = "/v1/models"

    def __init__(
        self, venv: str | None, gguf: str, *, max_model_len: int, threads: int, eos_token_ids: list[int],
        extra_args: list[str] | None = None, extra_env: dict[str, Any] | None = None,
        startup_timeout_s: float = 300.0, log_path: str | None = None, endpoint: str = "completions",
        timeout_s: float | None = None,
    ) -> None:
        self.venv = Path(venv or DEFAULT_LLAMACPP_VENV).expanduser()
        self.python = check_llamacpp(self.venv)
        super().__init__("", startup_timeout_s, log_path, endpoint=endpoint, timeout_s=timeout_s,
                         server_timing=False)
        self.extra_body |= {"repeat_penalty": 1.0}
        self.eos_bias = {str(t): -100.0 for t in eos_token_ids}
        self.args = ["--model", gguf, "--model_alias", SERVED_NAME, "--n_ctx", str(max_model_len),
                     "--n_threads", str(threads), "--n_threads_batch", str(threads), "--interrupt_requests", "False",
                     "--seed", "0", *(extra_args or [])]
        self.extra_env = {k: str(v) for k, v in (extra_env or {}).items()}

    def command(self) -> list[str]:
        return [str(self.python), "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", str(self.port),
                *self.args]

    def environment(self) -> dict[str, str]:
        return _clean_env() | {"PYTHONUNBUFFERED": "1"} | self.extra_env

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        if spec.prompt is None:
            raise ValueError(f"{spec.request_id}: target=llamacpp takes text prompts "
                             "(workload.prompt_as_token_ids=false)")
        body = super().payload(dataclasses.replace(spec, prompt_token_ids=None))  # the text is sent
        if body.pop("ignore_eos", False):
            body["logit_bias"] = dict(self.eos_bias)
        return body
