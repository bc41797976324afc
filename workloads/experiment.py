"""One experiment: build the workload, start the target, drive it, write the run folder.

Whatever happens (a failing target, Ctrl-C, a bad request), the run folder ends up
valid: config.yaml first, then requests.csv / steps.csv / summary.json with what was
measured, error.txt with the reason when the run did not complete, and report.html.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from analysis import runfolder
from conf.schema import RunConfig
from workloads.driver import Driver, RunResult
from workloads.factory import plan_workload
from workloads.run_summary import slo_of, write_results
from workloads.send_schedule import send_limits
from workloads.targets.registry import target_kind
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


def _report(run_dir: Path) -> Path | None:
    from reports.run_report import build_report

    try:
        return build_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the measurements are already on disk
        runfolder.write_error(run_dir, f"report failed: {type(exc).__name__}: {exc}")
        return None


def _run(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    engine_config = cfg.engine_config(shape_dir=run_dir / "shapes")
    kind = target_kind(cfg.target.kind)
    if kind.run is not None:  # the kind runs the experiment itself (offline, simulated)
        ran = kind.run(cfg, engine_config, run_dir)
        return write_results(cfg, run_dir, ran.result, ran.reference, ran.compile_time_s, ran.summary)
    assert kind.make is not None
    target, tokenizer, max_len = kind.make(cfg, engine_config, run_dir)
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


def _drive(cfg: RunConfig, target: Any, specs: list, run_dir: Path) -> RunResult:
    from profiling.telemetry import TelemetrySampler
    from workloads.saturation import SaturationMonitor

    closed_loop, concurrency = send_limits(cfg)
    scrape = cfg.target.metrics_interval_s if target_kind(cfg.target.kind).scraped else None
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
