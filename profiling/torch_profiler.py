"""torch.profiler around engine steps, writing <run>/trace.json and <run>/kernels.csv.

Usage (what the engine's hooks do, see `profiling.engine_hooks`):

    with StepProfiler(run_dir, wait=1, warmup=1, active=3) as prof:
        for step in steps:
            with prof.step_range(step):
                with prof.phase("forward", step):
                    ...
            prof.profiler_step()

Ranges are `record_function` annotations named `servelab::<phase>#step=<n>`; the
kernel table (`profiling.kernel_table`) finds steps and phases by that name. Only the
schedule's active steps are recorded. On `finish()` (or leaving the `with` block) the
Chrome trace(s) of every active window are merged into one `trace.json` and the
per-step category times go to `kernels.csv` (`step, category, time_ms`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from profiling.kernel_table import kernel_table, per_step

ENGINE_PHASES = ("schedule", "prepare_inputs", "forward", "attention", "sample", "update", "detokenize")


def range_name(phase: str, step_idx: int) -> str:
    """Name of the record_function range of one phase of one step."""
    return f"servelab::{phase}#step={step_idx}"


class StepProfiler:
    """torch.profiler with a wait/warmup/active schedule over engine steps.

    `run_dir` receives trace.json and kernels.csv. CUDA activity is recorded when
    torch sees a GPU. Not thread-safe: call it from the engine's step loop only.
    """

    def __init__(
        self,
        run_dir: str | Path,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._parts: list[dict[str, Any]] = []
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=self._collect,
            record_shapes=record_shapes,
        )
        self._started = False
        self._finished = False

    def _collect(self, prof: profile) -> None:
        part = self.run_dir / f".trace_part{len(self._parts)}.json"
        prof.export_chrome_trace(str(part))
        self._parts.append(json.loads(part.read_text()))
        part.unlink()

    def start(self) -> StepProfiler:
        if not self._started:
            self._prof.start()
            self._started = True
        return self

    @contextmanager
    def step_range(self, step_idx: int) -> Iterator[None]:
        """Annotates one whole engine step."""
        with record_function(range_name("step", step_idx)):
            yield

    @contextmanager
    def phase(self, name: str, step_idx: int) -> Iterator[None]:
        """Annotates one phase (e.g. "forward") of one step; nest inside `step_range`."""
        with record_function(range_name(name, step_idx)):
            yield

    def profiler_step(self) -> None:
        """Advances the schedule; call once after every engine step."""
        self._prof.step()

    def finish(self) -> dict[str, Path]:
        """Stops profiling and writes trace.json and kernels.csv; returns their paths.

        Writes nothing when no active window was reached (too few steps).
        """
        if self._finished:
            return self._outputs()
        self._finished = True
        if self._started:
            self._prof.stop()
        if not self._parts:
            return {}
        trace = dict(self._parts[0])
        trace["traceEvents"] = [e for part in self._parts for e in part.get("traceEvents", [])]
        (self.run_dir / "trace.json").write_text(json.dumps(trace))
        per_step(kernel_table(trace["traceEvents"])).to_csv(self.run_dir / "kernels.csv", index=False)
        return self._outputs()

    def _outputs(self) -> dict[str, Path]:
        paths = {"trace": self.run_dir / "trace.json", "kernels": self.run_dir / "kernels.csv"}
        return {k: p for k, p in paths.items() if p.exists()}

    def __enter__(self) -> StepProfiler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()
