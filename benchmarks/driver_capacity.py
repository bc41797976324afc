"""How fast can the load driver send? Open loop against an instant ScriptedTarget.

The target answers without sleeping, so everything measured is the driver: achieved send
rate and lateness (actual send - planned send). Goal on 2 CPU cores: >= 1,000 req/s with
p99 lateness < 5 ms.

    python benchmarks/driver_capacity.py [--rate 1000] [--seconds 3] [--arrivals constant|poisson]
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from workloads.arrivals import constant_arrivals, poisson_arrivals
from workloads.driver import run_workload
from workloads.spec import RequestSpec
from workloads.targets.scripted import Script, ScriptedTarget


def build(rate: float, seconds: float, arrivals: str, output_tokens: int) -> list[RequestSpec]:
    n = int(rate * seconds)
    rng = np.random.default_rng(0)
    times = constant_arrivals(n, rate) if arrivals == "constant" else poisson_arrivals(n, rate, rng)
    return [RequestSpec(f"r{i}", float(t), None, [1, 2, 3, 4], 4, output_tokens) for i, t in enumerate(times)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--arrivals", choices=["constant", "poisson"], default="poisson")
    ap.add_argument("--output-tokens", type=int, default=4)
    args = ap.parse_args()
    specs = build(args.rate, args.seconds, args.arrivals, args.output_tokens)
    target = ScriptedTarget(Script(tokens_per_chunk=1), instant=True)
    result = asyncio.run(run_workload(specs, target))
    sends = np.array([r.start_s for r in result.records])
    late_ms = np.array([r.lateness_s for r in result.records]) * 1000.0
    span = sends.max() - sends.min()
    achieved = (len(sends) - 1) / span if span > 0 else float("inf")
    ok = achieved >= 0.98 * args.rate and np.percentile(late_ms, 99) < 5.0
    print(
        f"requests: {len(specs)}  planned rate: {args.rate:.0f} req/s ({args.arrivals})  "
        f"output tokens/request: {args.output_tokens}"
    )
    print(f"achieved send rate: {achieved:.0f} req/s  failed: {sum(not r.ok for r in result.records)}")
    print(
        f"lateness ms: p50 {np.percentile(late_ms, 50):.3f}  p99 {np.percentile(late_ms, 99):.3f}  "
        f"max {late_ms.max():.3f}"
    )
    print("PASS" if ok else "FAIL", "(goal: achieved >= 98% of planned, p99 lateness < 5 ms)")


if __name__ == "__main__":
    main()
