"""Per-token ITL over HTTP when the server batches tokens into SSE chunks (issue 16, item 1).

    python benchmarks/http_itl.py [--rounds 3] [--chunk-tokens 4] [hydra overrides...]

The same workbench workload runs on two targets, alternating round by round (so slow drift of
a shared machine falls on both):
1. `target=inprocess`: the engine in the harness process; ITL from the engine's outputs;
2. `target=server` with `server.stream_chunk_tokens=4`: servelab-serve sends 4 tokens per SSE
   chunk, and the harness takes per-token ITL from the servelab timing extension (the engine's
   own token times); the per-chunk ITL (what any other client would see) is printed beside it.
Both use the same scheduler budget and all cores. The goal: the HTTP per-token ITL within 5%
of the in-process one (median of the rounds' ratios), the per-chunk figure about 4x larger.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

WORKLOAD = ["workload=fixed", "workload.num_requests=24", "workload.warmup_requests=4",
            "workload.prompt_len.value=64", "workload.output_len.value=48", "workload.concurrency=4",
            "scheduler.max_num_batched_tokens=512", "report.html=false", "run.time_reference=false",
            "profiling.telemetry=false"]


def run_once(target: list[str], overrides: list[str], run_dir: Path) -> dict:
    from conf.schema import RunConfig, compose_typed
    from workloads.experiment import run_experiment

    cfg = compose_typed(RunConfig, "run", [*WORKLOAD, *target, *overrides])
    outcome = run_experiment(cfg, run_dir)
    if outcome.error:
        raise SystemExit(f"http_itl: {' '.join(target)}: {outcome.error}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, default=4)
    args, overrides = ap.parse_known_args()
    targets = {
        "inprocess": ["target=inprocess"],
        "server": ["target=server", f"+target.server={{stream_chunk_tokens: {args.chunk_tokens}}}"],
    }
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            order = list(targets.items()) if k % 2 == 0 else list(targets.items())[::-1]
            got = {name: run_once(t, overrides, Path(tmp) / f"{name}_{k}") for name, t in order}
            srv, inp = got["server"], got["inprocess"]
            rows.append({"round": k, "inprocess_itl_ms": inp["mean_itl_ms"], "server_itl_ms": srv["mean_itl_ms"],
                         "server_itl_chunk_ms": srv.get("mean_itl_chunk_ms"),
                         "itl_source": srv.get("sources", {}).get("itl"),
                         "ratio": srv["mean_itl_ms"] / inp["mean_itl_ms"]})
            r = rows[-1]
            print(f"round {k}: in-process ITL {r['inprocess_itl_ms']:.2f} ms, HTTP per-token {r['server_itl_ms']:.2f} "
                  f"ms (source {r['itl_source']}), HTTP per-chunk {r['server_itl_chunk_ms']:.2f} ms, "
                  f"ratio {r['ratio']:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rows)
    chunk = statistics.median(r["server_itl_chunk_ms"] / r["server_itl_ms"] for r in rows)
    print(f"median over {len(rows)} rounds: HTTP per-token / in-process ITL = {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f}%), per-chunk / per-token = {chunk:.2f}x ({args.chunk_tokens} tokens per chunk)")
    print(f"goal: within 5% -> {'MET' if abs(ratio - 1) <= 0.05 else 'NOT MET'}")


if __name__ == "__main__":
    main()
