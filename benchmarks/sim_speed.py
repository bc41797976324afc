"""How fast is the simulator? One hour of the Azure conversation trace on a simulated 70B deployment.

The acceptance case of the capacity-planning issue: 19,366 requests of
`AzureLLMInferenceTrace_conv.csv` for a Llama-3-70B-shaped model, bf16, tensor parallel 8 on
H200s (roofline step model, KV cache sized from the hardware), through the engine's own
scheduler. Goal: under 2 minutes on 2 cores. Prints wall time, simulated time, requests, steps.

    python benchmarks/sim_speed.py [--trace ../shared/traces/AzureLLMInferenceTrace_conv.csv]
        [--first-n N] [--hardware h200] [--tp 8] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import cProfile
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.sim.executor import SimulatedExecutor
from engine.sim.model_counts import load_arch
from workloads.simulate import SimResult, simulate, trace_token_specs
from workloads.traces import fit_to_context, load_trace, slice_rows

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def run(trace: Path, first_n: int | None, model: str, hardware: str, tp: int, progress: bool) -> SimResult:
    arch = load_arch(model)
    rows, _ = load_trace(trace)
    rows = fit_to_context(slice_rows(rows, first_n=first_n), arch.max_position_embeddings)
    specs = trace_token_specs(rows, arch.vocab_size)
    cfg = EngineConfig.from_kwargs(model, dtype="bfloat16", max_num_batched_tokens=8192, max_num_seqs=256)
    ex = SimulatedExecutor.from_names(cfg, arch, hardware, tp=tp)
    return simulate(specs, cfg, ex, progress=progress)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--first-n", type=int, default=None, help="only the first N requests")
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--profile", type=Path, default=None, help="write cProfile stats here")
    args = ap.parse_args()
    if not args.trace.is_file():
        raise SystemExit(f"error: trace not found: {args.trace}")
    t0 = time.perf_counter()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    res = run(args.trace, args.first_n, args.model, args.hardware, args.tp, args.progress)
    if prof:
        prof.disable()
        prof.dump_stats(args.profile)
    total = time.perf_counter() - t0
    summ = res.summary()
    print(f"requests   {len(res.records)} ({summ['completed']} completed)")
    print(f"steps      {len(res.steps)}")
    print(f"simulated  {res.sim_s:.1f} s")
    print(f"wall       {res.wall_s:.1f} s simulate(), {total:.1f} s with loading ({res.sim_s / res.wall_s:.0f}x real time)")
    print(f"mean TTFT {summ['mean_ttft_ms']:.1f} ms, mean TPOT {summ['mean_tpot_ms']:.2f} ms, "
          f"preemptions {summ['num_preemptions']}, output {summ['output_throughput']:.0f} tok/s")


if __name__ == "__main__":
    main()
