"""Targets backed by servelab's own engine.

- `EngineTarget`: the in-process engine (AsyncLLM with its EngineCore in a thread of
  this process). Token times come from the engine (the end of the step that made each
  token), not from chunk arrival; the tokens of one step form one chunk (so the per-chunk
  figures are the engine's too), and each request carries the engine's queued /
  prefill / decode split. Every engine step's `StepStats` is kept.
- `ServerTarget`: a server process (`engine.entrypoints.serve --config <file>`) the
  harness starts on a free local port and stops itself; requests go over HTTP through
  `OpenAITarget`, engine state comes from scraping `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from analysis.record import TargetResult
from engine.config import EngineConfig
from engine.frontend.async_llm import AsyncLLM
from engine.hooks import StepHooks
from engine.sampling_params import SamplingParams
from engine.seam import StepStats
from workloads.spec import RequestSpec
from workloads.targets.base import OnToken
from workloads.targets.openai import OpenAITarget

SHUTDOWN_TIMEOUT_S = 120.0  # the profiled engine's last trace export


def sampling_params_for(spec: RequestSpec) -> SamplingParams:
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=spec.ignore_eos)


def _step_chunks(times: list[float], offset: float) -> list[tuple[float, int]]:
    """The tokens one engine step made as one chunk (as a server streams them): (time + offset,
    tokens) per run of equal token times. Speculative decoding makes several tokens a step."""
    chunks: list[tuple[float, int]] = []
    for t in times:
        if chunks and t + offset == chunks[-1][0]:
            chunks[-1] = (chunks[-1][0], chunks[-1][1] + 1)
        else:
            chunks.append((t + offset, 1))
    return chunks


class EngineTarget:
    name = "inprocess"

    def __init__(self, engine_config: EngineConfig, hooks_factory: Callable[[], StepHooks] | None = None) -> None:
        self.engine_config = engine_config
        self.hooks_factory = hooks_factory
        self.llm: AsyncLLM | None = None
        self._steps: list[StepStats] = []
        # engine clock (time.time) -> driver clock (perf_counter)
        self._offset = time.perf_counter() - time.time()

    def load(self) -> AsyncLLM:
        """Start the engine (blocks while the model loads); idempotent."""
        if self.llm is None:
            # The hooks are built in the engine's thread (torch.profiler records per thread).
            self.adopt(AsyncLLM.from_config(self.engine_config, multiprocess=False, hooks_factory=self.hooks_factory))
        return self.llm  # type: ignore[return-value]

    def adopt(self, llm: AsyncLLM) -> None:
        """Drive an engine that is already running (another target's), recording its steps from now on:
        the engine keeps no steps itself, so a target that is handed `llm` without this sees none."""
        self.llm = llm
        llm.step_listeners.append(self._steps.append)

    def release(self) -> None:
        """Stop recording the adopted engine's steps (it goes on running for its owner)."""
        if self.llm is not None and self._steps.append in self.llm.step_listeners:
            self.llm.step_listeners.remove(self._steps.append)
        self.llm = None

    async def start(self) -> None:
        self.load()
        self._offset = time.perf_counter() - time.time()
        self._steps.clear()  # drop steps from before the run (the model's warm-up)

    async def stop(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.llm is not None:
            # The engine closes its hooks as it stops: give a profiler time to write its trace.
            self.llm.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S if self.hooks_factory is not None else 5.0)
            self.llm = None

    async def send(self, spec: RequestSpec, on_token: OnToken | None = None) -> TargetResult:
        assert self.llm is not None, "start() first"
        res = TargetResult()
        prompt = spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt
        seen = 0
        try:
            async for out in self.llm.generate(prompt, sampling_params_for(spec), request_id=spec.request_id,
                                               priority=spec.priority):
                comp = out.outputs[0]
                times = out.metrics.token_times
                for t_perf, k in _step_chunks(times[seen:], self._offset):
                    res.chunk_times.append(t_perf)
                    res.chunk_tokens.append(k)
                    if on_token is not None:
                        on_token(t_perf, k)
                seen = len(times)
                if out.finished:
                    self._finish(res, out, comp)
        except ValueError as exc:
            res.error = f"invalid request: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
            res.error = f"{type(exc).__name__}: {exc}"
        res.done_time = time.perf_counter()
        return res

    @staticmethod
    def _finish(res: TargetResult, out: Any, comp: Any) -> None:
        m = out.metrics
        res.prompt_tokens = len(out.prompt_token_ids)
        res.output_tokens = len(comp.token_ids)
        res.finish_reason = comp.finish_reason or ""
        res.output_token_ids = list(comp.token_ids)
        res.output_text = comp.text
        if m.token_times:
            res.engine_token_offsets = [t - m.token_times[0] for t in m.token_times]
            res.server_ttft_s = m.token_times[0] - m.arrival_time
            res.server_e2el_s = m.token_times[-1] - m.arrival_time
        if m.first_scheduled_time:
            res.server_queued_s = m.queued_time
            res.server_prefill_s = m.prefill_time
            res.server_decode_s = m.decode_time
        res.spec_draft_tokens, res.spec_accepted_tokens = m.num_draft_tokens, m.num_accepted_tokens
        if getattr(m, "kv_bytes_loaded", 0) or getattr(m, "kv_bytes_saved", 0):
            res.kv = m.kv_figures()
        if comp.finish_reason == "error":
            res.error = "engine error"

    def step_stats(self) -> list[StepStats] | None:
        return list(self._steps)

    async def scrape_metrics(self) -> dict[str, float] | None:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerTarget(OpenAITarget):
    """A server process started and stopped by the harness; its whole configuration is the one
    YAML file `config_path` (sections of `engine.config` plus `server:`), the port a flag."""

    name = "server"

    def __init__(
        self, config_path: str | os.PathLike[str], startup_timeout_s: float = 180.0, log_path: str | None = None,
        endpoint: str = "completions", timeout_s: float | None = None, server_timing: bool = True,
    ) -> None:
        self.port = free_port()
        # model "": OpenAITarget.start asks the server's /v1/models for its served name
        super().__init__(f"http://127.0.0.1:{self.port}", model="", endpoint=endpoint,
                         extra_body={"temperature": 0.0}, timeout_s=timeout_s, server_timing=server_timing)
        self.config_path = os.fspath(config_path)
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        if self.proc is None:
            await self._launch()
        await super().start()

    label = "servelab-serve"  # names the server in start-up errors
    health_path = "/health"  # answers 200 once the server takes requests

    def command(self) -> list[str]:
        return [sys.executable, "-m", "engine.entrypoints.serve", "--config", self.config_path,
                "--port", str(self.port)]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    async def _launch(self) -> None:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment())
        deadline = time.monotonic() + self.startup_timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.label} exited with code {self.proc.returncode} during start-up"
                                       + (f" (log: {self.log_path})" if self.log_path else ""))
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{self.base_url}{self.health_path}") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.label} not ready after {self.startup_timeout_s:.0f} s")

    def shutdown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
