"""One experiment: build the workload, start the target, drive it, write the run folder.

Whatever happens (a failing target, Ctrl-C, a bad request), the run folder ends up
valid: config.yaml first, then requests.csv / steps.csv / summary.json with what was
measured, error.txt with the reason when the run did not complete, and report.html.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from conf.schema import RunConfig
from engine.config import EngineConfig
from engine.tokenizer import get_tokenizer
from workloads import runfolder
from workloads.driver import Driver, RunResult
from workloads.factory import build_workload
from workloads.run_summary import slo_of, write_results
from workloads.send_schedule import send_limits
from workloads.time_reference import timed

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    report: Path | None = None


def run_experiment(cfg: RunConfig, run_dir: str | Path) -> Outcome:
    """Run the experiment `cfg` describes into `run_dir`; never raises for a failed run."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.replay:
        try:
            cfg = with_recorded_workload(cfg)
        except (ValueError, OSError) as exc:
            runfolder.write_error(run_dir, str(exc))
            return Outcome(run_dir, error=str(exc))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    outcome = Outcome(run_dir)
    try:
        outcome.summary = _run(cfg, run_dir)
        if outcome.summary.get("stop_reason") == "cancelled":  # Ctrl-C while the driver ran
            outcome.error = "interrupted (Ctrl-C); the summary covers the requests finished before (partial)"
    except KeyboardInterrupt:
        outcome.error = "interrupted (Ctrl-C)"
    except Exception as exc:  # noqa: BLE001 - recorded in error.txt, shown as one line
        outcome.error = f"{type(exc).__name__}: {exc}"
        (run_dir / "traceback.txt").write_text(traceback.format_exc())
    if outcome.error:
        runfolder.write_error(run_dir, outcome.error)
        if outcome.summary is None:  # what finished before the stop is kept, marked partial
            outcome.summary = runfolder.recover_partial(run_dir, slo_of(cfg), outcome.error)
    if cfg.report.html:
        outcome.report = _report(run_dir)
    return outcome


def with_recorded_workload(cfg: RunConfig) -> RunConfig:
    """`cfg` with the workload section of the run folder `cfg.replay` (workloads/replay.py)."""
    from dataclasses import replace

    from conf.schema import WorkloadSection
    from workloads.replay import recorded_workload

    return replace(cfg, workload=recorded_workload(cfg.replay, WorkloadSection))  # type: ignore[arg-type]


def plan_workload(cfg: RunConfig, tokenizer: Any, max_len: int, run_dir: Path) -> tuple[list, dict]:
    """The run's requests (replayed when `cfg.replay`), recorded in <run_dir>/workload.jsonl."""
    from workloads.replay import replayed, write_workload

    specs, extra = build_workload(cfg.workload, tokenizer, max_len)
    if cfg.replay:
        specs = replayed(specs, cfg.replay)
        extra = {**(extra or {}), "replay_of": str(cfg.replay)}
    write_workload(run_dir, specs)
    return specs, extra


def _report(run_dir: Path) -> Path | None:
    from reports.run_report import build_report

    try:
        return build_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the measurements are already on disk
        runfolder.write_error(run_dir, f"report failed: {type(exc).__name__}: {exc}")
        return None


def _run(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    engine_config = cfg.engine_config(shape_dir=run_dir / "shapes")
    kind = cfg.target.kind
    if kind == "simulated":
        return _run_simulated(cfg, engine_config, run_dir)
    if kind == "offline":
        return _run_offline(cfg, engine_config, run_dir)
    target, tokenizer, max_len = _make_target(cfg, engine_config, run_dir)
    try:
        specs, extra = plan_workload(cfg, tokenizer, max_len, run_dir)
        if extra:
            (run_dir / "workload_info.json").write_text(json.dumps(extra, indent=2, default=str))
        result, reference = timed(cfg, lambda: _drive(cfg, target, specs, run_dir))
        compile_s = _compile_time(target)  # read before shutdown drops the engine
    finally:
        _shutdown(target)
    return write_results(cfg, run_dir, result, reference, compile_s)


def _compile_time(target: Any) -> float | None:
    """Start-up compile + warm-up seconds of an in-process engine (None for other targets)."""
    ready = getattr(getattr(getattr(target, "llm", None), "client", None), "ready", None)
    return None if ready is None else float(ready.compile_time_s)


def _make_target(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path):
    from workloads.targets.engine import EngineTarget, ServerTarget
    from workloads.targets.openai import OpenAITarget

    kind = cfg.target.kind
    if kind == "inprocess":
        target = EngineTarget(engine_config, hooks_factory=_hooks_factory(cfg, run_dir))
        llm = target.load()
        return target, llm.tokenizer, llm.max_model_len
    tokenizer = get_tokenizer(engine_config.model)
    if kind == "server":
        target = ServerTarget(write_serve_config(engine_config, run_dir, cfg.target.server),
                              cfg.target.startup_timeout_s, str(run_dir / "server.log"),
                              endpoint=cfg.target.endpoint, timeout_s=cfg.target.request_timeout_s,
                              server_timing=cfg.target.server_timing)
        return target, tokenizer, _max_model_len(engine_config)
    if kind == "pd":
        from workloads.targets.pd import PDTarget

        t = cfg.target
        target = PDTarget(engine_config, run_dir, t.num_prefill, t.num_decode, t.router_policy, t.startup_timeout_s,
                          endpoint=t.endpoint, timeout_s=t.request_timeout_s, connector=t.kv_connector)  # fmt: skip
        return target, tokenizer, _max_model_len(engine_config)
    if kind == "openai":
        if not cfg.target.url:
            raise ValueError("target.url is required for target=openai")
        target = OpenAITarget(cfg.target.url, cfg.target.model_name or "", cfg.target.api_key,
                              cfg.target.endpoint, extra_body={"temperature": 0.0},
                              timeout_s=cfg.target.request_timeout_s, server_timing=cfg.target.server_timing)
        return target, tokenizer, _max_model_len(engine_config)
    if kind == "vllm":
        from engine.platform import resolve_engine_dtype
        from workloads.targets.peer import VLLMTarget

        t, sched = cfg.target, engine_config.scheduler
        target = VLLMTarget(t.venv, t.hf_model, max_num_seqs=sched.max_num_seqs,
                            max_num_batched_tokens=sched.max_num_batched_tokens,
                            max_model_len=_max_model_len(engine_config),
                            dtype=resolve_engine_dtype(cfg.model.dtype, cfg.device.device, cfg.model.model),
                            extra_args=list(t.peer_args), extra_env=dict(t.peer_env),
                            startup_timeout_s=t.startup_timeout_s, log_path=str(run_dir / "server.log"),
                            endpoint=t.endpoint, timeout_s=t.request_timeout_s)
        return target, tokenizer, _max_model_len(engine_config)
    if kind == "llamacpp":
        from engine.model.source import embedded_gguf_path
        from workloads.targets.peer import LlamaCppTarget

        t = cfg.target
        gguf = t.gguf or str(embedded_gguf_path())
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        target = LlamaCppTarget(t.venv, gguf, max_model_len=_max_model_len(engine_config), threads=len(os.sched_getaffinity(0)),
                                eos_token_ids=eos, extra_args=list(t.peer_args), extra_env=dict(t.peer_env),
                                startup_timeout_s=t.startup_timeout_s, log_path=str(run_dir / "server.log"),
                                endpoint=t.endpoint, timeout_s=t.request_timeout_s)
        return target, tokenizer, _max_model_len(engine_config)
    raise ValueError(f"target.kind: unknown {kind!r} (inprocess|offline|server|openai|vllm|llamacpp|simulated|pd)")


def _max_model_len(engine_config: EngineConfig) -> int:
    from engine.model.loader import resolve_model

    arch, _, _ = resolve_model(engine_config.model)
    return arch.max_model_len(engine_config.model.max_model_len, engine_config.model.allow_long_max_model_len)


def write_serve_config(engine_config: EngineConfig, run_dir: Path, server: dict[str, Any] | None = None) -> Path:
    """This run's engine config as the one file the server target hands `engine.entrypoints.serve`
    (`--config`); `server` (target.server) fills the server section, the target picks the port."""
    path = run_dir / "serve_config.yaml"
    data = asdict(engine_config)
    if server:
        data["server"] = {k: v for k, v in dict(server).items() if k not in ("host", "port")}
    path.write_text("# written by servelab-run for its server target (engine.entrypoints.serve --config)\n"
                    + yaml.safe_dump(data, sort_keys=False))  # fmt: skip
    return path


def _hooks_factory(cfg: RunConfig, run_dir: Path):
    if not cfg.profiling.enabled:
        return None
    p = cfg.profiling

    def factory():
        from profiling.engine_hooks import StepProfilerHooks
        from profiling.torch_profiler import StepProfiler

        return StepProfilerHooks(StepProfiler(run_dir, wait=p.wait, warmup=p.warmup, active=p.active,
                                              repeat=p.repeat, record_shapes=p.record_shapes))

    return factory


def _drive(cfg: RunConfig, target: Any, specs: list, run_dir: Path) -> RunResult:
    from profiling.telemetry import TelemetrySampler
    from workloads.saturation import SaturationMonitor

    closed_loop, concurrency = send_limits(cfg)
    scrape = cfg.target.metrics_interval_s if cfg.target.kind in ("server", "openai", "pd", "vllm", "llamacpp") else None
    journal = runfolder.RequestJournal(run_dir)
    monitor = SaturationMonitor() if cfg.run.stop_when_saturated and not closed_loop else None
    driver = Driver(target, closed_loop=closed_loop, concurrency=concurrency,
                    max_duration_s=cfg.run.max_duration_s, progress=True, scrape_interval_s=scrape,
                    on_record=journal, saturation=monitor)

    sigint = _SigintWatch()

    async def go() -> RunResult:
        await target.start()
        sampler = None
        sigint.install()
        try:
            if cfg.profiling.telemetry:
                # A server target's own process tree (server + EngineCore), else the harness's.
                server = getattr(target, "proc", None)
                sampler = TelemetrySampler(run_dir, cfg.profiling.telemetry_interval_s,
                                           pid=server.pid if server is not None else None)
                sampler.start()
            return await driver.run(specs)
        finally:
            sigint.remove()
            if sampler is not None:
                sampler.stop()
            await target.stop()

    try:
        result = asyncio.run(go())
    finally:
        journal.close()
    if sigint.seen and not result.stop_reason:
        result.stop_reason = "cancelled"  # Ctrl-C came while the run was ending: still a partial run
    return result


class _SigintWatch:
    """Ctrl-C while the driver runs: cancel the run (the driver keeps what finished) and remember
    it, so the run is reported as interrupted wherever the cancellation lands; a second Ctrl-C
    stops at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.seen = False
        self._task: asyncio.Task[Any] | None = None

    def install(self) -> None:
        self._task = asyncio.current_task()
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            self._task = None

    def _on_sigint(self) -> None:
        if self.seen or self._task is None:
            raise KeyboardInterrupt
        self.seen = True
        self._task.cancel()

    def remove(self) -> None:
        if self._task is not None:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
            self._task = None


def _shutdown(target: Any) -> None:
    stop = getattr(target, "shutdown", None)
    if stop is not None:
        stop()


def _run_simulated(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> dict[str, Any]:
    from engine.sim.executor import SimulatedExecutor
    from workloads.simulate import simulate

    s = cfg.sim
    tp, ep = cfg.sim_parallel()
    executor = SimulatedExecutor.from_names(engine_config, engine_config.model.model, s.hardware, tp=tp,
                                            step_model=s.step_model, dtype=s.dtype, token_id=int(s.token_id),
                                            gpu_memory_utilization=s.gpu_memory_utilization, ep=ep)
    tokenizer = get_tokenizer(engine_config.model)
    specs, extra = plan_workload(cfg, tokenizer, executor_max_len(executor, engine_config), run_dir)
    if extra:
        (run_dir / "workload_info.json").write_text(json.dumps(extra, indent=2, default=str))
    closed_loop, concurrency = send_limits(cfg)
    if not closed_loop and concurrency is not None:
        raise ValueError("workload.arrival.max_concurrency: the simulated target does not cap an open loop yet; "
                         "use a closed loop (workload.concurrency=N) or another target")
    res = simulate(specs, engine_config, executor, progress=True, closed_loop=closed_loop,
                   concurrency=concurrency, tokenize=tokenizer.encode, max_duration_s=cfg.run.max_duration_s)
    result = RunResult(records=res.records, t0_wall=0.0, wall_s=res.sim_s, steps=res.steps)
    summary = write_results(cfg, run_dir, result, None)
    summary["simulation_wall_s"] = res.wall_s
    runfolder.write_summary(run_dir, summary)
    return summary


def executor_max_len(executor: Any, engine_config: EngineConfig) -> int:
    executor_len = getattr(executor, "max_model_len", None)
    if executor_len is None:
        executor.initialize()
        executor_len = executor.max_model_len
    return int(executor_len)


def _run_offline(cfg: RunConfig, engine_config: EngineConfig, run_dir: Path) -> dict[str, Any]:
    """Every request handed to `LLM.generate` at once (vLLM's offline benchmark shape).

    Arrival times are ignored; scheduling is then deterministic, which is what the CI
    gate compares (steps, tokens per step, prefix hits, preemptions).
    """
    from engine.llm import LLM
    from workloads.record_builder import build_record
    from workloads.targets.engine import sampling_params_for

    llm = LLM(config=engine_config)
    compile_time_s = llm.engine_core.executor.compile_time
    factory = _hooks_factory(cfg, run_dir)
    if factory is not None:
        llm.engine_core.set_hooks(factory())
    try:
        specs, _ = plan_workload(cfg, llm.tokenizer, llm.engine_core.max_model_len, run_dir)
        prompts = [s.prompt_token_ids if s.prompt_token_ids is not None else s.prompt for s in specs]
        params = [sampling_params_for(s) for s in specs]

        def generate_all() -> tuple[list[Any], float, float]:
            t0_wall, t0 = time.time(), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=True)
            return outs, t0_wall, time.perf_counter() - t0

        (outs, t0_wall, done), reference = timed(cfg, generate_all)
    finally:
        llm.engine_core.shutdown()
    records = []
    for spec, out in zip(specs, outs, strict=True):
        comp = out.outputs[0]
        m = out.metrics
        records.append(build_record(
            spec, scheduled_s=0.0, start_s=0.0, token_times=[t - t0_wall for t in m.token_times], done_s=done,
            prompt_tokens=len(out.prompt_token_ids), output_tokens=len(comp.token_ids),
            finish_reason=comp.finish_reason or "",
            server_queued_s=m.queued_time, server_prefill_s=m.prefill_time, server_decode_s=m.decode_time,
            spec_draft_tokens=m.num_draft_tokens, spec_accepted_tokens=m.num_accepted_tokens,
            kv=m.kv_figures() if m.kv_bytes_loaded or m.kv_bytes_saved else None,
        ))
    result = RunResult(records=records, t0_wall=t0_wall, wall_s=done, steps=llm.step_stats)
    return write_results(cfg, run_dir, result, reference, compile_time_s)
