"""Test helpers for the online-serving tests: an echo EngineCore and server launching.

`EchoEngineCore` has the EngineCore API (add_request / abort_requests / finish_requests / step /
has_unfinished_requests / shutdown / max_model_len / num_blocks / scheduler) and
"generates" by echoing the prompt's token ids one per step, so the process, IPC and
failure handling can be tested without a model. A prompt containing POISON_TOKEN makes
`step()` raise, to exercise the step-error path.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.core_client import EngineCoreClient
from engine.frontend.async_llm import AsyncLLM
from engine.hooks import NULL_HOOKS, StepHooks
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, StepStats

POISON_TOKEN = 200  # a non-ASCII byte: inside the byte-level vocabulary, absent from test prompts
ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass
class _EchoKV:
    scheduler: _EchoScheduler

    @property
    def num_used_blocks(self) -> int:
        return self.scheduler.blocks_per_request * len(self.scheduler.requests)

    @property
    def num_total_blocks(self) -> int:
        return EchoEngineCore.num_blocks

    @property
    def other_groups(self) -> list[Any]:  # one KV cache group, as for a model with one attention type
        return []


@dataclass
class _EchoScheduler:
    blocks_per_request: int = 2
    requests: dict[str, tuple[EngineCoreRequest, list[int]]] = field(default_factory=dict)

    @property
    def num_running(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def kv_cache_manager(self) -> _EchoKV:
        return _EchoKV(self)


class EchoEngineCore:
    max_model_len = 128
    num_blocks = 64

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.scheduler = _EchoScheduler()
        self.step_count = 0
        self.step_delay_s = config.scheduler.step_delay_ms / 1000
        # (request id, status) of every request the front end finished (stop strings).
        self.finished_by_front_end: list[tuple[str, RequestStatus]] = []
        self.hooks: StepHooks = NULL_HOOKS

    def set_hooks(self, hooks: StepHooks) -> None:
        self.hooks = hooks

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.requests[req.request_id] = (req, [])

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            self.scheduler.requests.pop(rid, None)

    def finish_requests(self, ids: list[str], status: RequestStatus) -> None:
        self.finished_by_front_end.extend((rid, status) for rid in ids if rid in self.scheduler.requests)
        self.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def step(self) -> EngineCoreOutputs:
        time.sleep(self.step_delay_s)
        now = time.time()
        self.step_count += 1
        outs = [self._advance(rid, now) for rid in list(self.scheduler.requests)]
        stats = StepStats(
            step=self.step_count,
            time=now,
            num_decode_tokens=len(outs),
            num_running=self.scheduler.num_running,
            kv_blocks_used=self.scheduler.kv_cache_manager.num_used_blocks,
            kv_blocks_total=self.num_blocks,
            num_finished=sum(o.finish_reason is not None for o in outs),
        )
        return EngineCoreOutputs(outputs=outs, stats=stats, timestamp=now)

    def _advance(self, rid: str, now: float) -> EngineCoreOutput:
        req, generated = self.scheduler.requests[rid]
        if POISON_TOKEN in req.prompt_token_ids:
            raise RuntimeError("poisoned request")
        token = req.prompt_token_ids[len(generated) % len(req.prompt_token_ids)]
        generated.append(token)
        out = EngineCoreOutput(request_id=rid, new_token_ids=[token], arrival_time=req.arrival_time)
        if len(generated) == 1:
            out.first_scheduled_time = out.first_token_time = now
        if len(generated) >= req.max_tokens:
            out.finish_reason = int(FinishReason.LENGTH)
            out.finished_time = now
            del self.scheduler.requests[rid]
        return out

    def shutdown(self) -> None:
        self.scheduler.requests.clear()
        self.hooks.close()


def make_echo_engine(config: EngineConfig) -> EchoEngineCore:
    return EchoEngineCore(config)


def echo_async_llm(multiprocess: bool = False, step_delay_ms: float = 0.0) -> AsyncLLM:
    """An AsyncLLM over the echo engine with the byte-level tokenizer and the real processors."""
    from engine.frontend.output_processor import OutputProcessor
    from engine.frontend.processor import InputProcessor
    from engine.tokenizer import Tokenizer

    cfg = EngineConfig()
    cfg.scheduler.step_delay_ms = step_delay_ms
    tok = Tokenizer.byte_level()
    client = EngineCoreClient.start(cfg, multiprocess=multiprocess, engine_factory=make_echo_engine,
                                    ready_timeout_s=30)
    max_len = EchoEngineCore.max_model_len
    return AsyncLLM(client, tok, InputProcessor(tok, max_len), OutputProcessor(tok), max_len)


def echo_request(rid: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        arrival_time=time.time(),
        max_tokens=max_tokens,
    )


# ---- real server processes -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


def start_server(tmp_dir: Path, *overrides: str, ready_timeout_s: float = 240.0,
                 omp_threads: int | None = 1) -> ServerProcess:
    """Start `python -m engine.entrypoints.serve` on a free port; wait for /v1/models.

    `omp_threads`: the server's OMP_NUM_THREADS (1 keeps the tests' servers off each other's cores);
    None leaves the environment's, so the server picks its own engine threads as a user's would."""
    import urllib.request

    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    cmd = [PYTHON, "-m", "engine.entrypoints.serve", "--port", str(port), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log_path)
    api_key = next((o.split("=", 1)[1] for o in overrides if o.startswith("server.api_key=")), None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            req = urllib.request.Request(server.base_url + "/v1/models", headers=headers)
            with urllib.request.urlopen(req, timeout=1) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {ready_timeout_s} s:\n{server.log()}")
