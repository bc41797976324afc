"""The time reference: a fixed matmul workload timed beside each run, so that gates compare
time metrics of runs on machines (or moments) of different speed.

A run measures it before and after its workload (`run.time_reference`) and records the mean
as summary.json `time_reference_s`, with the threads it ran on as `time_reference_cores`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from conf.schema import RunConfig

T = TypeVar("T")


def measure_time_reference(repeats: int = 7, iterations: int = 40, cores: int | None = None) -> float:
    """Seconds of a fixed matmul workload on this machine, now: the best of `repeats`.

    The workload runs once on each of `cores` Python threads at the same time (default: the
    torch threads the engine uses), each thread single-threaded (no barrier spinning: ~1%
    spread on one core, where one torch op on two threads spreads ~20%), and a repeat takes
    as long as its slowest thread. A core taken by other work is then seen: on a 2-core Zen 4
    guest, one busy neighbour process left a one-core reference unchanged (0.060 s) and made
    this one 0.065 -> 0.10 s, as it slows the engine's two-thread steps.

    Gates normalise time metrics by it; runs measure it before and after the workload and
    record the mean, so a machine that got busier during the run is seen in both.
    """
    a0 = torch.randn(384, 384, generator=torch.Generator().manual_seed(0)) / 20
    cores = cores or torch.get_num_threads()

    def work() -> None:
        a = a0
        for _ in range(iterations):
            a = torch.tanh(a @ a)  # releases the GIL: the threads run on their own cores

    best = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            workers = [threading.Thread(target=work) for _ in range(cores)]
            t = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return best


def reference_cores(cfg: RunConfig) -> int:
    """The threads the time reference runs on: the engine's (`device.num_threads`, else torch's)."""
    return cfg.device.num_threads or torch.get_num_threads()


def timed(cfg: RunConfig, work: Callable[[], T]) -> tuple[T, float | None]:
    """`work()`, and (when `run.time_reference`) the mean of the time reference before and after it."""
    if not cfg.run.time_reference:
        return work(), None
    cores = reference_cores(cfg)
    before = measure_time_reference(cores=cores)
    result = work()
    return result, (before + measure_time_reference(cores=cores)) / 2
