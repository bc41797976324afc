"""Arrival processes: planned send times (seconds since run start) for N requests.

Definitions follow vLLM's benchmark (METRICS.md):
- Poisson at rate r: exponential gaps with mean 1/r (gamma with burstiness 1).
- Gamma with burstiness b: gaps ~ Gamma(shape=b, scale=1/(r*b)); b < 1 is burstier than
  Poisson, large b tends to constant spacing. Like vLLM, the cumulative times are rescaled so
  the last arrival lands exactly at N/r (`rescale=False` keeps the raw draws).
- Constant rate: arrival i at (i+1)/r (so the last one is at N/r, as above).
- Linear ramp: the rate moves from r0 to r1 linearly over the requests (request i uses
  r0 + (r1 - r0) * i/(N-1)); gaps are 1/rate(i), or gamma draws at that rate when a
  burstiness is given. No rescaling (as in vLLM's ramp-up).
- Closed loop: every arrival is 0; the driver's concurrency paces the requests.
"""

from __future__ import annotations

import numpy as np

from workloads.spec import RequestSpec


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator, rescale: bool = True) -> np.ndarray:
    """[n] arrival times of a Poisson process at `rate` req/s."""
    return gamma_arrivals(n, rate, 1.0, rng, rescale=rescale)


def gamma_arrivals(
    n: int, rate: float, burstiness: float, rng: np.random.Generator, rescale: bool = True
) -> np.ndarray:
    """[n] arrival times with Gamma(shape=b, scale=1/(rate*b)) gaps."""
    _check(n, rate)
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if rescale and n > 0 and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


def constant_arrivals(n: int, rate: float) -> np.ndarray:
    """[n] evenly spaced arrival times, 1/rate apart, the first at 1/rate."""
    _check(n, rate)
    return np.arange(1, n + 1, dtype=np.float64) / rate


def ramp_arrivals(
    n: int, rate_start: float, rate_end: float, rng: np.random.Generator | None = None,
    burstiness: float | None = None,
) -> np.ndarray:
    """[n] arrival times with the rate going linearly from rate_start to rate_end."""
    _check(n, min(rate_start, rate_end))
    progress = np.arange(n) / max(n - 1, 1)
    rates = rate_start + (rate_end - rate_start) * progress
    if burstiness is None:
        gaps = 1.0 / rates
    else:
        if rng is None:
            raise ValueError("a random ramp (burstiness given) needs rng")
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rates * burstiness))
    return np.cumsum(gaps)


def closed_loop_arrivals(n: int) -> np.ndarray:
    """[n] zeros: closed-loop requests are paced by the driver's concurrency."""
    return np.zeros(n)


def make_arrivals(
    kind: str, n: int, rng: np.random.Generator, *, rate: float = 1.0, burstiness: float = 1.0,
    rate_end: float | None = None,
) -> np.ndarray:
    """Build arrival times from config: poisson|gamma|constant|ramp|closed."""
    if kind == "poisson":
        return poisson_arrivals(n, rate, rng)
    if kind == "gamma":
        return gamma_arrivals(n, rate, burstiness, rng)
    if kind == "constant":
        return constant_arrivals(n, rate)
    if kind == "ramp":
        if rate_end is None:
            raise ValueError("ramp arrivals need rate_end")
        return ramp_arrivals(n, rate, rate_end, rng, None if burstiness == 1.0 else burstiness)
    if kind == "closed":
        return closed_loop_arrivals(n)
    raise ValueError(f"unknown arrival process {kind!r}")


def mark_warmup(specs: list[RequestSpec], num_warmup: int) -> list[RequestSpec]:
    """Flag the first `num_warmup` specs (in arrival order) as warm-up; returns the list."""
    for spec in specs[:num_warmup]:
        spec.is_warmup = True
    return specs


def interarrival_cv(times: np.ndarray) -> float:
    """Coefficient of variation (std / mean) of the gaps between sorted arrival times."""
    gaps = np.diff(np.sort(np.asarray(times, dtype=np.float64)))
    if len(gaps) == 0 or gaps.mean() == 0:
        return 0.0
    return float(gaps.std() / gaps.mean())


def _check(n: int, rate: float) -> None:
    if n < 0:
        raise ValueError("n must be >= 0")
    if rate <= 0:
        raise ValueError("rate must be > 0")
