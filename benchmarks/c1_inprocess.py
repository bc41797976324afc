"""Batch 1 in process: servelab's offline engine against llama.cpp on the same GGUF file (issue 38, item 3).

Both engines read the same file's Q4_1 / Q8_0 blocks as stored: servelab's block kernels
(`model.quantized_decode=true`, its default) and llama-cpp-python's `Llama` (`make
peers-llamacpp`). Like for like:
- the same prompts (random token ids, `--input-len`), the same number of output tokens
  (`--output-len`, EOS ignored on both sides), greedy, one request at a time, `--threads` threads
  on both sides, a context of 2,048 tokens;
- each side runs in a fresh process of its own per round (llama.cpp in its side venv:
  benchmarks/llamacpp_c1_worker.py), one at a time, in ABBA order over `--rounds`; each process
  decodes `--warmup` prompts at the measured shape first and drops them;
- per round and side: the median over the prompts of TPOT (time between the first and the last
  token over the tokens between) and of TTFT (the prompt's evaluation and the first token);
  reported as the median (min-max) over the rounds, the ratio servelab / llama.cpp in the same round;
- each round records what it ran on (benchmarks/round_conditions.py): processes busy outside the
  benchmark, runnable threads and CPU steal while it ran, and the rate a buffer of the step's bytes
  read just before it; a round more than 5% off its side's median names what differed;
- the floor: the bytes a batch-1 step reads (servelab: its block packs and the quantized LM head,
  as its start-up log says; llama.cpp: the GGUF's matmul tensors as stored; on both sides the
  keys and values the mean measured step attends, side_by_side.kv_read_bytes) at the best rate
  `torch.sum` reads a buffer of that many bytes, again and again, on the same threads, before and
  after the rounds (the median of the two): a step's ~96 MB can sit in a large last-level cache
  and read at twice the memory's rate, so a bigger buffer's rate would flatter the engines. The
  rate beyond every cache (`memory`, a buffer of twice the last-level cache) and the floor at it
  are printed beside it.

    .venv/bin/python benchmarks/c1_inprocess.py --rounds 3 --json c1.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import (  # noqa: E402
    ROOT,
    cpu_flags,
    cpu_model,
    format_flags,
    format_rates,
    rate_at,
    read_bandwidth,
    read_rates,
    step_floors,
)
from round_conditions import RoundConditions, RunnableSampler, busy_processes, format_slow_rounds, slow_rounds  # noqa: E402
from serving_sides import random_prompts  # noqa: E402
from side_by_side import (  # noqa: E402
    abba_order,
    format_cv,
    format_spread,
    kv_read_bytes,
    ratio_spread,
    spread,
    step_read_bytes,
)

sys.path.insert(0, str(ROOT))
from workloads.targets.peer import DEFAULT_LLAMACPP_VENV, PeerMissingError, check_llamacpp  # noqa: E402

WORKER_TIMEOUT_S = 1800


def tpot_s(token_times: list[float]) -> float | None:
    """Mean seconds between tokens after the first (None under 2 tokens)."""
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def servelab_worker() -> None:
    """`--worker`: the servelab side of one round, job on stdin, JSON on stdout (as llamacpp_c1_worker)."""
    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    from engine.llm import LLM
    from engine.model.batch_invariance import block_step_bytes
    from engine.sampling_params import SamplingParams
    from workloads.explain_probe import find_model

    llm = LLM(model="smollm2", max_num_seqs=1, max_model_len=2048)
    params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)

    def one(prompt: list[int]) -> dict[str, Any]:
        t0 = time.time()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        times = out.metrics.token_times
        return {"ttft_s": times[0] - t0, "token_times": [t - t0 for t in times]}

    for prompt in job["prompts"][: job["warmup"]]:
        one(prompt)
    requests = [one(p) for p in job["prompts"][job["warmup"] :]]
    model = find_model(llm)
    step_bytes = block_step_bytes(model) if model is not None else None
    llm.engine_core.shutdown()
    print(json.dumps({"requests": requests, "step_bytes": step_bytes[0] if step_bytes else None}))


def run_side(side: str, job: dict[str, Any], llama_python: Path) -> dict[str, Any]:
    """One round of `side` in a fresh process; its JSON."""
    if side == "servelab":
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    else:
        cmd = [str(llama_python), str(Path(__file__).with_name("llamacpp_c1_worker.py"))]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": str(job["threads"])}  # fmt: skip
    proc = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, env=env,
                          timeout=WORKER_TIMEOUT_S, check=False)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} worker failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def round_figures(res: dict[str, Any]) -> dict[str, float | None]:
    """A round's medians over its prompts: TPOT and TTFT in ms."""
    tpots = [t for r in res["requests"] if (t := tpot_s(r["token_times"])) is not None]
    return {"tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
            "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in res["requests"])}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds, a fresh process per side each (default: 3)")
    p.add_argument("--prompts", type=int, default=8, help="measured prompts per round and side (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="prompts decoded first and dropped (default: 2)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, EOS ignored (default: 128)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="both sides' threads "
                   "(default: torch's, %(default)s here)")  # fmt: skip
    p.add_argument("--llamacpp-venv", type=Path, default=DEFAULT_LLAMACPP_VENV, help="llama-cpp-python's side venv")
    p.add_argument("--json", type=Path, help="write every round's figures and the summary here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.prompts < 1 or args.warmup < 0 or args.output_len < 2 or args.input_len < 1:
        p.error("--rounds, --prompts, --input-len need 1 or more, --output-len 2 or more, --warmup 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        servelab_worker()
        return 0
    try:
        llama_python = check_llamacpp(args.llamacpp_venv.expanduser())
    except PeerMissingError as e:
        print(f"c1_inprocess: {e}", file=sys.stderr)
        return 2
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model
    from engine.model.source import embedded_gguf_path

    gguf = embedded_gguf_path()
    torch.set_num_threads(args.threads)
    arch = resolve_model(ModelConfig())[0]
    kv = kv_read_bytes(arch.num_layers, arch.num_kv_heads, arch.head_dim, args.input_len, args.output_len)
    weights: dict[str, float | None] = {"llamacpp": step_read_bytes("llamacpp", 0, gguf)["bytes"], "servelab": None}
    step_bytes = {"llamacpp": _plus(weights["llamacpp"], kv), "servelab": None}
    rates_before = read_rates([step_bytes["llamacpp"]])
    vocab = arch.vocab_size
    prompts = random_prompts(args.warmup + args.prompts, args.input_len, vocab, seed=38)
    job = {"model": str(gguf), "threads": args.threads, "prompts": prompts, "output_len": args.output_len,
           "warmup": args.warmup}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    versions: dict[str, str] = {}
    for rnd, order in enumerate(abba_order(args.rounds, "servelab", "llamacpp")):
        for side in order:
            print(f"[{side}] round {rnd + 1}", flush=True)
            cond = RoundConditions(busy=busy_processes(), step_read_rate=read_bandwidth(step_bytes["llamacpp"], 0.3))
            with RunnableSampler() as runnable:
                res = run_side(side, job, llama_python)
            cond.runnable_mean, cond.steal = runnable.mean, runnable.steal
            fig = round_figures(res)
            if side == "servelab":
                weights["servelab"] = step_read_bytes("servelab-blocks", 0, gguf, res.get("step_bytes"))["bytes"]
                step_bytes["servelab"] = _plus(weights["servelab"], kv)
            if side == "llamacpp":
                versions["llama-cpp-python"] = res.get("version", "?")
            rounds.append({"round": rnd, "side": side, **fig, "conditions": cond.as_dict()})
            print(f"  TPOT p50 {fig['tpot_ms']:.2f} ms  TTFT p50 {fig['ttft_ms']:.1f} ms", flush=True)
    rates_after = read_rates(step_bytes.values())
    rates = floor_rates(step_bytes, rates_before, rates_after)
    summary = summarize(rounds, step_bytes, rates, args.rounds)
    summary["step_bytes"] = {"weights": weights, "kv": kv}
    print()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; flags: {format_flags(cpu_flags())}; torch {torch.__version__}; "
          f"llama-cpp-python {versions.get('llama-cpp-python', '?')}")  # fmt: skip
    print(f"workload: {args.prompts} prompts (+{args.warmup} warm-up) x {args.input_len} random tokens, {args.output_len} "
          f"output tokens, greedy, EOS ignored, batch 1, {args.threads} threads, the same GGUF ({gguf.name}); "
          f"{args.rounds} rounds ABBA, a fresh process per side and round")  # fmt: skip
    print(rates_line(rates_before, rates_after, args.threads))
    print(step_bytes_line(weights, kv, args.input_len, args.output_len))
    for line in format_summary(summary):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                                         "summary": summary, "versions": versions,
                                         "read_rates": {"before": rates_before, "after": rates_after}}, indent=2))  # fmt: skip
    return 0


SLOW_FIGURES = {"tpot_ms": False, "ttft_ms": False}  # round_conditions.slow_rounds: lower is better


def floor_rates(step_bytes: dict[str, float | None], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per side the read rate at its step's bytes (the median of before and after where both
    measured it) and the rate beyond every cache (the same median)."""
    out: dict[str, Any] = {"memory": statistics.median([before["memory"]["rate"], after["memory"]["rate"]])}
    for side, b in step_bytes.items():
        if b:
            got = [rate for r in (before, after) if (rate := rate_at(r, b, within=0.01)) is not None]
            out[side] = statistics.median(got) if got else None
    return out


def _plus(a: float | None, b: float) -> float | None:
    return a + b if a else None


def step_bytes_line(weights: dict[str, float | None], kv: float, input_len: int, output_len: int) -> str:
    """What a side's step reads, in parts: its matrices as stored and the keys and values it attends."""
    parts = ", ".join(f"{side} {w / 1e6:.1f} MB of matrices" if w else f"{side} matrices unknown"
                      for side, w in weights.items())  # fmt: skip
    return (f"a step reads: {parts}; + {kv / 1e6:.2f} MB of keys and values each (the mean step of a TPOT attends "
            f"{input_len + output_len / 2:.0f} positions; 16-bit on both sides)")


def rates_line(before: dict[str, Any], after: dict[str, Any], threads: int) -> str:
    return (f"read rates (torch.sum, best, {threads} threads; GB/s): before the rounds {format_rates(before)}; "
            f"after {format_rates(after)}")


def summarize(rounds: list[dict[str, Any]], step_bytes: dict[str, float | None], rates: dict[str, Any],
              n: int) -> dict[str, Any]:  # fmt: skip
    """Per side the spread over rounds of TPOT and TTFT, same-round ratios, and the floor multiples:
    `floor_ms` at the rate a buffer of the step's bytes reads (the floor), `memory_floor_ms` at the
    rate beyond every cache (what the step would take if its bytes came from memory each step)."""
    by = {s: [next((r for r in rounds if r["side"] == s and r["round"] == k), None) for k in range(n)]
          for s in ("servelab", "llamacpp")}  # fmt: skip
    out: dict[str, Any] = {"sides": {}, "ratio": {}}
    for side, rs in by.items():
        f = step_floors(step_bytes[side], rates.get(side), rates.get("memory"))
        tpot = [r["tpot_ms"] if r else None for r in rs]
        out["sides"][side] = {
            "tpot_ms": spread(tpot), "ttft_ms": spread(r["ttft_ms"] if r else None for r in rs),
            "step_bytes": step_bytes[side], **f,
            **{f"tpot_over_{k[:-3]}": spread(t / f[k] if t and f[k] else None for t in tpot)
               for k in ("floor_ms", "memory_floor_ms")},
            "slow_rounds": slow_rounds([(r["round"], r, r.get("conditions", {})) for r in rs if r], SLOW_FIGURES),
        }  # fmt: skip
    for key in ("tpot_ms", "ttft_ms"):
        out["ratio"][key] = ratio_spread([r[key] if r else None for r in by["servelab"]],
                                         [r[key] if r else None for r in by["llamacpp"]])  # fmt: skip
    return out


def format_summary(summary: dict[str, Any]) -> list[str]:
    lines = [f"  {'side':<10} {'TPOT p50 ms':>22} {'TTFT p50 ms':>24} {'step reads':>12} {'floor ms':>16} "
             f"{'TPOT / floor':>20} {'memory floor ms':>16} {'TPOT / memory floor':>20}"]  # fmt: skip
    for side, s in summary["sides"].items():
        mb = f"{s['step_bytes'] / 1e6:.1f} MB" if s["step_bytes"] else "n/a"
        floor = f"{s['floor_ms']:.2f} ({s['read_rate'] / 1e9:.0f} GB/s)" if s["floor_ms"] else "n/a"
        mfloor = f"{s['memory_floor_ms']:.2f}" if s["memory_floor_ms"] else "n/a"
        lines.append(f"  {side:<10} {format_spread(s['tpot_ms'], '.2f'):>22} {format_spread(s['ttft_ms']):>24} "
                     f"{mb:>12} {floor:>16} {format_spread(s['tpot_over_floor'], '.2f') + 'x':>20} {mfloor:>16} "
                     f"{format_spread(s['tpot_over_memory_floor'], '.2f') + 'x':>20}")  # fmt: skip
        lines.append(f"  {'':<10} {format_cv(s['tpot_ms']):>22} {format_cv(s['ttft_ms']):>24}")
    for side, s in summary["sides"].items():
        lines += ["  " + line for line in format_slow_rounds(side, s.get("slow_rounds", []))]
    r = summary["ratio"]
    lines.append(f"  servelab / llama.cpp, same round: TPOT {format_spread(r['tpot_ms'], '.2f')}x, "
                 f"TTFT {format_spread(r['ttft_ms'], '.2f')}x")  # fmt: skip
    lines.append("  floor: the step's bytes at the rate a buffer of that size reads (it may sit in the last-level "
                 "cache); memory floor: at the rate beyond every cache")
    return lines


if __name__ == "__main__":
    sys.exit(main())
