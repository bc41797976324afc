"""TEST-ONLY slowdown injector: makes the model's forward slower by a known fraction.

`SERVELAB_TEST_SLOWDOWN=0.10` (off when unset or 0) makes every forward spin on the thread's
CPU clock for 10% of the CPU time the forward itself took, so both wall-clock and CPU-time
measures see a forward 10% slower. It exists so the CI performance gate's power can be
measured (benchmarks/gate_power.py, docs/benchmarks.md); never set it anywhere else.
"""

from __future__ import annotations

import os
import time

ENV = "SERVELAB_TEST_SLOWDOWN"


def slowdown_fraction() -> float:
    """The configured fraction (0.0 when off); a one-line ValueError for a bad value."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}: expected a fraction such as 0.10, got {raw!r}") from None
    if not 0.0 <= value <= 10.0:
        raise ValueError(f"{ENV}: expected a fraction in [0, 10], got {value}")
    return value


def spin_cpu(seconds: float) -> None:
    """Busy-wait until this thread has used `seconds` more CPU time (so CPU clocks see it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
