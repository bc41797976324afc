"""Per-step kernel-time breakdown from a Chrome trace written by torch.profiler.

Contract of `kernel_table(trace_events)`:

- Input: the `traceEvents` list of a Chrome trace. Step and phase ranges are
  `record_function` annotations named `servelab::<phase>#step=<n>` (see
  `profiling.torch_profiler.range_name`); `<phase>` is `step` for the whole step.
- Time source: when the trace holds device kernels (`cat == "kernel"`, a GPU run),
  their durations are used; each kernel is placed at the CPU timestamp of the runtime
  call that launched it (matched by `args.correlation`), because the GPU runs it later
  than the step range that asked for it. Without kernels (a CPU run), aten ops are used
  with their *self* time (duration minus direct children), so nested ops
  (`aten::linear` -> `aten::addmm`) are never counted twice.
- Output: one row per timed event inside a step range, columns
  `step, phase, context, name, category, time_ms`. `phase` is the outermost phase
  range under the step (an op in `attention` inside `forward` has phase `forward`),
  `context` the innermost one (used by the category rules: inside an `attention`
  range every op but data movement counts as attention; inside `sample`, softmax and
  friends count as sampling). Events outside every step
  range are dropped. On a CPU run each outermost phase of a step also gets one `host` row:
  the phase's duration minus its ops' self times (Python and dispatch between ops), so a
  step's rows add up to its phases' durations.

`per_step(table)` aggregates to the `kernels.csv` schema: `step, category, time_ms`.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

CATEGORIES = ("gemm", "attention", "norm_act", "sampling", "copy", "other", "host")
RANGE_RE = re.compile(r"^servelab::(?P<phase>[A-Za-z_]+)#step=(?P<step>-?\d+)$")
COLUMNS = ["step", "phase", "context", "name", "category", "time_ms"]

_ATTENTION = re.compile(r"attn|attention|flash|sdpa|scaled_dot_product|fmha|paged")
_SAMPLING = re.compile(r"topk|top_k|multinomial|argmax|radix|sampl|\bsort")
_SAMPLING_IN_RANGE = re.compile(r"softmax|cumsum|exponential|div|gather|scatter|where|max\b")
_GEMM = re.compile(r"addmm|\bmm\b|bmm|linear|matmul|cutlass|gemm|gemv|xmma|cublas|\bdot\b")
_NORM_ACT = re.compile(
    r"rms|layer_norm|norm|silu|gelu|relu|sigmoid|tanh|\bmul\b|mul_|rsqrt|\bpow\b|\bmean\b"
    r"|\badd\b|add_|\bsub\b|\bdiv\b|\bexp\b|\bneg\b|act_and_mul|rotary|rope|elementwise|softmax"
)
_COPY = re.compile(
    r"copy|\bto\b|_to_copy|index|\bcat\b|contiguous|clone|memcpy|memset|embedding|gather"
    r"|scatter|fill|zero_|\bstack\b|empty_like"
)


def _short(name: str) -> str:
    """Lower-case op/kernel name without the `aten::` namespace."""
    return name.lower().removeprefix("aten::")


def categorize(name: str, context: str | None = None) -> str:
    """Category of one op or kernel, given the innermost servelab phase around it."""
    n = _short(name)
    if _ATTENTION.search(n):
        return "attention"
    if context == "attention":  # the backend's own ops (masking, softmax, matmuls), data moves aside
        return "copy" if _COPY.search(n) else "attention"
    if _SAMPLING.search(n) or (context == "sample" and _SAMPLING_IN_RANGE.search(n)):
        return "sampling"
    for category, pattern in (("gemm", _GEMM), ("norm_act", _NORM_ACT), ("copy", _COPY)):
        if pattern.search(n):
            return category
    return "other"


@dataclass(frozen=True, slots=True)
class _Range:
    phase: str
    step: int
    start: float  # us
    end: float  # us


@dataclass(slots=True)
class _Timed:
    name: str
    ts: float  # us, where it is placed on the CPU timeline
    time_us: float


def _ranges(events: Iterable[Mapping[str, Any]]) -> list[_Range]:
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        m = RANGE_RE.match(str(e.get("name", "")))
        if m:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
            out.append(_Range(m["phase"], int(m["step"]), ts, ts + dur))
    return out


def _cpu_self_times(ops: list[Mapping[str, Any]]) -> list[_Timed]:
    """Self time of CPU ops: duration minus direct children, nesting per thread."""
    by_thread: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out: list[_Timed] = []
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[tuple[float, _Timed]] = []  # (end ts, record)
        for e in thread_ops:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while stack and stack[-1][0] <= ts:
                stack.pop()
            rec = _Timed(str(e["name"]), ts, dur)
            if stack:
                stack[-1][1].time_us -= dur
            stack.append((ts + dur, rec))
            out.append(rec)
    for rec in out:
        rec.time_us = max(rec.time_us, 0.0)
    return out


def _gpu_kernels(events: list[Mapping[str, Any]]) -> list[_Timed]:
    """Device kernels placed at the CPU timestamp of the launch that enqueued them."""
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    out = []
    for e in events:
        if e.get("cat") == "kernel":
            corr = e.get("args", {}).get("correlation")
            out.append(_Timed(str(e["name"]), launch_ts.get(corr, float(e["ts"])), float(e.get("dur", 0.0))))
    return out


class _RangeIndex:
    """Finds the step and phase ranges around a timestamp (bisect over step starts)."""

    def __init__(self, ranges: list[_Range]) -> None:
        self.steps = sorted((r for r in ranges if r.phase == "step"), key=lambda r: r.start)
        self.starts = [r.start for r in self.steps]
        self.phases: dict[int, list[_Range]] = {}
        for r in sorted((r for r in ranges if r.phase != "step"), key=lambda r: r.start):
            self.phases.setdefault(r.step, []).append(r)

    def locate(self, ts: float) -> tuple[int, str, str] | None:
        """(step, outermost phase, innermost phase) of the ranges containing `ts`."""
        i = bisect.bisect_right(self.starts, ts) - 1
        if i < 0 or ts >= self.steps[i].end:
            return None
        step = self.steps[i].step
        hits = [r for r in self.phases.get(step, []) if r.start <= ts < r.end]
        if not hits:
            return step, "step", "step"
        return step, hits[0].phase, hits[-1].phase


def kernel_table(trace_events: list[Mapping[str, Any]]) -> pd.DataFrame:
    """Timed ops/kernels per step with their category (see the module docstring)."""
    events = [e for e in trace_events if e.get("ph") == "X"]
    ranges = _ranges(events)
    timed = _gpu_kernels(events)
    if not timed:
        timed = _cpu_self_times([e for e in events if e.get("cat") == "cpu_op"])
    index = _RangeIndex(ranges)
    rows = []
    for rec in timed:
        where = index.locate(rec.ts)
        if where is None:
            continue
        step, phase, context = where
        rows.append((step, phase, context, rec.name, categorize(rec.name, context), rec.time_us / 1e3))
    table = pd.DataFrame(rows, columns=COLUMNS)
    if not any(e.get("cat") == "kernel" for e in events):
        table = pd.concat([table, _host_rows(index, table)], ignore_index=True)
    return table


HOST_NAME = "(host: Python and dispatch between ops)"


def _host_rows(index: _RangeIndex, table: pd.DataFrame) -> pd.DataFrame:
    """CPU runs: per step and outermost phase, the range's time not inside any op (category host).

    With them a step's rows add up to its phases' durations: nothing measured is unaccounted.
    """
    op_ms = table.groupby(["step", "phase"])["time_ms"].sum().to_dict() if not table.empty else {}
    rows = []
    for step_range in index.steps:
        outer_end = -1.0
        for r in index.phases.get(step_range.step, []):
            if r.start < outer_end or r.start < step_range.start or r.end > step_range.end:
                continue  # nested in an earlier phase, or outside the step (front-end detokenize)
            outer_end = r.end
            gap = (r.end - r.start) / 1e3 - op_ms.get((step_range.step, r.phase), 0.0)
            rows.append((step_range.step, r.phase, r.phase, HOST_NAME, "host", max(gap, 0.0)))
    return pd.DataFrame(rows, columns=COLUMNS)


def per_step(table: pd.DataFrame) -> pd.DataFrame:
    """Aggregate a `kernel_table` to the kernels.csv schema: step, category, time_ms."""
    if table.empty:
        return pd.DataFrame(columns=["step", "category", "time_ms"])
    agg = table.groupby(["step", "category"], as_index=False)["time_ms"].sum()
    return agg.sort_values(["step", "category"]).reset_index(drop=True)


def phase_durations(trace_events: list[Mapping[str, Any]]) -> pd.DataFrame:
    """Duration of every servelab range: columns step, phase, duration_ms."""
    rows = [(r.step, r.phase, (r.end - r.start) / 1e3) for r in _ranges(trace_events)]
    return pd.DataFrame(rows, columns=["step", "phase", "duration_ms"])
