"""servelab-trace: analyze a request trace, or synthesize a new one like it.

    servelab-trace analyze PATH [--block-size 16] [--trace-block-size 512] [--window-s 60] [--out F.json]
    servelab-trace synthesize PATH --num-requests N [--rate-scale K] [--seed S] [--out F.jsonl]

PATH is an Azure, Mooncake or BurstGPT trace or the workbench's JSONL (format detected from its
first line, or --format). `analyze` prints the figures and writes them as JSON (default
`<trace name>.analysis.json` in the current folder); `synthesize` writes the workbench's JSONL
(default `<trace name>.synth.jsonl`), which `workload.trace.path` replays. See
workloads/trace_tools.py for what each figure means and how a trace is synthesized.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workloads.trace_tools import analyze_trace, synthesize_trace, write_jsonl
from workloads.traces import MOONCAKE_BLOCK, load_trace


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="servelab-trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("analyze", "synthesize"):
        p = sub.add_parser(name)
        p.add_argument("path", type=Path)
        p.add_argument("--format", default="auto", choices=["auto", "azure", "mooncake", "burstgpt", "jsonl"])
        p.add_argument(
            "--trace-block-size",
            type=int,
            default=MOONCAKE_BLOCK,
            help="tokens named by one hash id (Mooncake: 512)",
        )
        p.add_argument("--out", type=Path, default=None)
    an = sub.choices["analyze"]
    an.add_argument("--block-size", type=int, default=16, help="the engine's KV block size for the hit rate")
    an.add_argument("--window-s", type=float, default=60.0, help="window of the rate-over-time series")
    syn = sub.choices["synthesize"]
    syn.add_argument("--num-requests", type=int, required=True)
    syn.add_argument("--rate-scale", type=float, default=1.0, help="k times the source's request rate")
    syn.add_argument("--seed", type=int, default=0)
    return ap


def format_analysis(name: str, a: dict[str, Any]) -> str:
    """The analysis as a few readable lines (the JSON holds everything)."""
    arr, ses = a["arrivals"], a["sessions"]
    lines = [f"{name}: {a['rows']} requests over {arr['span_s'] / 60:.1f} min"]
    for key in ("prompt_tokens", "output_tokens"):
        s = a[key]
        lines.append(f"  {key:<14} mean {s['mean']:9.1f}  p50 {s['p50']:8.0f}  p90 {s['p90']:8.0f}  "
                     f"p99 {s['p99']:8.0f}  max {s['max']:8.0f}")  # fmt: skip
    lines.append(
        f"  arrivals       {arr['rate']:.3f} req/s, gap CV {arr['interarrival_cv']:.2f}, {arr['zero_gaps']} zero gaps; "
        f"per {arr['window_s']:g} s window {arr['window_rate_min']:.2f}..{arr['window_rate_max']:.2f} req/s"
    )
    lines.extend(format_burstiness(arr))
    lines.append(
        f"  sessions       {ses['sessions']} ({ses['turns_mean']:.2f} turns mean, max "
        f"{ses['turns_max']:.0f}; {ses['multi_turn_row_share']:.1%} of rows in multi-turn sessions)"
    )
    if "prefix_cache" in a:
        pc = a["prefix_cache"]
        lines.append(
            f"  prefix cache   hit rate {pc['hit_rate']:.2%} at block {pc['block_size']} "
            f"(unbounded cache; {pc['hit_rate_at_trace_block']:.2%} at the trace's "
            f"{pc['trace_block_size']}-token blocks)"
        )
    return "\n".join(lines)


def format_burstiness(arr: dict[str, Any]) -> list[str]:
    """The resolution, batches, dispersion and gamma verdict lines (workloads/trace_arrivals.py)."""
    res, b = arr["resolution_s"], arr["batches"]
    grid = f"timestamps on a {res:g} s grid" if res is not None else "continuous timestamps"
    lines = [f"  timestamps     {grid}; {arr['tied_share']:.1%} of requests share the previous one's"]
    if arr["arrival_model"] == "batches":
        size, gap = b["size"], b["gap_s"]
        lines.append(f"  batches        {b['count']} of {size['mean']:.1f} requests mean (p90 {size['p90']:.0f}, max "
                     f"{size['max']:.0f}), {gap['mean']:.3g} s apart mean (CV {gap['cv']:.2f})")  # fmt: skip
    if arr["dispersion"]:
        per = ", ".join(f"{d['index_of_dispersion']:.2f} at {d['window_s']:.3g} s" for d in arr["dispersion"])
        lines.append(f"  dispersion     counts per window, variance / mean (1 = Poisson): {per}")
    verdict = "describes the gaps" if arr["gamma_describes_gaps"] else "does not describe the gaps"
    lines.append(f"  gamma fit      shape {arr['gamma_shape']:.3g} (1 = Poisson) {verdict}: {arr['gamma_note']}; "
                 f"synthesize draws {arr['arrival_model']}")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows, info = load_trace(args.path, args.format)
    stem = args.path.name.rsplit(".", 1)[0]
    if args.command == "analyze":
        result = analyze_trace(rows, block_size=args.block_size, trace_block=args.trace_block_size,
                               window_s=args.window_s)  # fmt: skip
        result["trace"] = {"path": str(args.path), "format": info.format}
        out = args.out or Path(f"{stem}.analysis.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(format_analysis(args.path.name, result))
        print(f"wrote {out}")
        return 0
    synth = synthesize_trace(rows, args.num_requests, rate_scale=args.rate_scale, seed=args.seed,
                             trace_block=args.trace_block_size)  # fmt: skip
    out = args.out or Path(f"{stem}.synth.jsonl")
    write_jsonl(synth, out)
    print(f"wrote {out}: {len(synth)} requests from {args.path.name} at {args.rate_scale:g}x its rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
