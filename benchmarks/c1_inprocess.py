"""Batch 1: servelab's offline engine against llama.cpp on the same GGUF file (issue 38, item 3; issue 55).

Both engines read the same file's Q4_1 / Q8_0 blocks as stored: servelab's block kernels
(`model.quantized_decode=true`, its default) and llama.cpp, two ways:
- `llama-bench` (llama.cpp's own, `make peers-llamacpp`: built natively): the figure llama.cpp's
  users quote. Its tg test at the measured depth, `llama-bench -p 0 -n <output-len> -d <input-len>
  -t <threads> -r <reps> -o json`: `output-len` tokens decoded one at a time after `input-len`
  tokens of context, the mean time per token; once per round, after the in-process pair;
- llama-cpp-python's `Llama.generate` loop in process (`make peers-llamacpp-python`), labelled
  `llama-cpp-python`: llama.cpp's kernels under a Python loop per token, as that binding's users
  run it; the same prompts and timing as servelab's side.
Either may be absent (the line says which `make` target builds it); at least one must be there.
Like for like:
- the same prompts (random token ids, `--input-len`), the same number of output tokens
  (`--output-len`, EOS ignored on both sides), greedy, one request at a time, `--threads` threads
  on every side, a context of 2,048 tokens;
- each in-process side runs in a fresh process of its own per round (llama-cpp-python in its side
  venv: benchmarks/llamacpp_c1_worker.py), one at a time, in ABBA order over `--rounds`; each
  process decodes `--warmup` prompts at the measured shape first and drops them (llama-bench warms
  up itself);
- per round and side: the median over the prompts of TPOT (time between the first and the last
  token over the tokens between) and of TTFT (the prompt's evaluation and the first token);
  reported as the median (min-max) over the rounds, the ratio servelab / peer in the same round;
- each round records what it ran on (benchmarks/round_conditions.py): processes busy outside the
  benchmark, runnable threads and CPU steal while it ran, and the rate a buffer of the step's bytes
  read just before it; a round more than 5% off its side's median names what differed;
- two floors, from the bytes a batch-1 step reads (servelab: its block packs and the quantized LM
  head, as its start-up log says; llama.cpp: the GGUF's matmul tensors as stored; on every side
  the keys and values the mean measured step attends, side_by_side.kv_read_bytes): the *DRAM-rate
  floor*, those bytes at the rate `torch.sum` reads a buffer beyond every cache (twice the
  last-level cache, at least 1 GiB): the bar that means the same on every machine, the one docs
  quote; and the *cache-rate floor*, at the best rate a buffer of the step's own size reads, again
  and again, on the same threads, before and after the rounds (the median of the two): a step's
  ~96 MB can sit in a large last-level cache and read at twice the memory's rate, so on such a
  machine no engine gets under it.

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
    LlamaCppBinaries,
    cpu_flags,
    cpu_model,
    format_flags,
    format_rates,
    llamacpp_binaries,
    llamacpp_missing,
    rate_at,
    read_bandwidth,
    read_rates,
    step_floors,
)
from round_conditions import RoundConditions, RunnableSampler, busy_processes, format_slow_rounds, slow_rounds  # noqa: E402
from serving_sides import model_gguf, random_prompts  # noqa: E402
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
# The sides, in the report's words: the key "llamacpp" is llama-cpp-python's in-process loop.
SIDE_LABEL = {"servelab": "servelab", "llamacpp": "llama-cpp-python", "llama-bench": "llama-bench"}
PEERS = ("llamacpp", "llama-bench")


def tpot_s(token_times: list[float]) -> float | None:
    """Mean seconds between tokens after the first (None under 2 tokens)."""
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def servelab_worker() -> None:
    """`--worker`: the servelab side of one round, job on stdin, JSON on stdout (as llamacpp_c1_worker)."""
    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    from engine.frontend.llm import LLM
    from engine.kernels.batch_invariance import block_step_bytes
    from engine.sampling_params import SamplingParams
    from workloads.explain_probe import find_model

    llm = LLM(model=job.get("model_name", "smollm2"), dtype=job.get("dtype", "auto"), max_num_seqs=1, max_model_len=2048)
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


def llama_bench_command(bins: LlamaCppBinaries, gguf: Path, input_len: int, output_len: int, threads: int,
                        reps: int) -> list[str]:  # fmt: skip
    """llama-bench's tg test at the measured depth: `output_len` tokens after `input_len` of context."""
    return [str(bins.bench), "-m", str(gguf), "-p", "0", "-n", str(output_len), "-d", str(input_len),
            "-t", str(threads), "-r", str(reps), "-o", "json"]  # fmt: skip


def llama_bench_figures(stdout: str, output_len: int) -> dict[str, Any]:
    """The tg row of llama-bench's JSON: TPOT (1000 / its mean tokens/s), its spread over the
    repetitions, and what it says of itself (build commit, CPU, backends, depth)."""
    rows = json.loads(stdout[stdout.index("[") :])
    tg = next(r for r in rows if int(r.get("n_gen", 0)) == output_len and int(r.get("n_prompt", 0)) == 0)
    return {"tpot_ms": 1e3 / float(tg["avg_ts"]), "ttft_ms": None, "tokens_per_s": float(tg["avg_ts"]),
            "stddev_ts": float(tg.get("stddev_ts", 0.0)), "depth": tg.get("n_depth"),
            "build": {k: tg.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "n_threads",
                                             "type_k", "type_v")}}  # fmt: skip


def run_llama_bench(bins: LlamaCppBinaries, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = llama_bench_command(bins, gguf, args.input_len, args.output_len, args.threads, args.llama_bench_reps)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=bins.env(), timeout=WORKER_TIMEOUT_S, check=False)
    if proc.returncode != 0 or "[" not in proc.stdout:
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()[-2000:]}")
    return llama_bench_figures(proc.stdout, args.output_len)


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
    p.add_argument("--llama-bench-reps", type=int, default=3, help="llama-bench's repetitions per round (default: 3)")
    p.add_argument("--no-llama-bench", dest="llama_bench", action="store_false", help="leave llama-bench out")
    p.add_argument("--no-llamacpp-python", dest="llamacpp_python", action="store_false",
                   help="leave llama-cpp-python's in-process loop out")
    p.add_argument("--model", default="smollm2", help="the packaged GGUF model every side reads: smollm2 (default) or "
                   "gemma3-270m")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="servelab's activations (default: auto, this CPU's fastest; float32 is what `auto` gives a CPU "
                        "without AVX512-BF16, e.g. with SERVELAB_CPU_MARCH=x86-64-v3 on an AVX-512 machine)")
    p.add_argument("--json", type=Path, help="write every round's figures and the summary here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.prompts < 1 or args.warmup < 0 or args.output_len < 2 or args.input_len < 1:
        p.error("--rounds, --prompts, --input-len need 1 or more, --output-len 2 or more, --warmup 0 or more")
    return args


def available_peers(args: argparse.Namespace) -> tuple[Path | None, LlamaCppBinaries, list[str]]:
    """llama-cpp-python's python (None where left out or missing), llama.cpp's binaries, and the
    peer sides that can run ("llamacpp", "llama-bench"); what is missing is printed, with the
    `make` target that builds it."""
    llama_python, missing = None, []
    if args.llamacpp_python:
        try:
            llama_python = check_llamacpp(args.llamacpp_venv.expanduser())
        except PeerMissingError as e:
            missing.append(f"llama-cpp-python: {e} (`make peers-llamacpp-python`)")
    bins = llamacpp_binaries()
    # only llama-bench runs here: a folder without llama-server will do
    bench_missing = llamacpp_missing(bins, ("bench",)) if args.llama_bench else "left out (--no-llama-bench)"
    if args.llama_bench and bench_missing:
        missing.append(f"llama-bench: {bench_missing}")
    for line in missing:
        print(f"c1_inprocess: left out {line}", file=sys.stderr)
    here = (["llamacpp"] if llama_python is not None else []) + (["llama-bench"] if not bench_missing else [])
    return llama_python, bins, here


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        servelab_worker()
        return 0
    llama_python, bins, peers_here = available_peers(args)
    if not peers_here:
        print("c1_inprocess: no llama.cpp side to measure against", file=sys.stderr)
        return 2
    from engine.config import ModelConfig
    from engine.model.loader import resolve_model
    gguf = model_gguf(args.model)
    torch.set_num_threads(args.threads)
    arch = resolve_model(ModelConfig(model=args.model))[0]
    kv = kv_read_bytes(arch.num_layers, arch.num_kv_heads, arch.head_dim, args.input_len, args.output_len)
    gguf_bytes = step_read_bytes("llamacpp", 0, gguf)["bytes"]
    weights: dict[str, float | None] = {"servelab": None} | {s: gguf_bytes for s in peers_here}
    step_bytes = {"servelab": None} | {s: _plus(gguf_bytes, kv) for s in peers_here}
    peer_bytes = _plus(gguf_bytes, kv)
    rates_before = read_rates([peer_bytes])
    vocab = arch.vocab_size
    prompts = random_prompts(args.warmup + args.prompts, args.input_len, vocab, seed=38)
    job = {"model": str(gguf), "model_name": args.model, "threads": args.threads, "prompts": prompts, "output_len": args.output_len,
           "warmup": args.warmup, "dtype": args.dtype}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    versions: dict[str, str] = {}
    pair = "llamacpp" if "llamacpp" in peers_here else "llama-bench"
    for rnd, order in enumerate(abba_order(args.rounds, "servelab", pair)):
        if pair == "llamacpp" and "llama-bench" in peers_here:
            order = [*order, "llama-bench"]  # after the in-process pair, every round
        for side in order:
            print(f"[{SIDE_LABEL[side]}] round {rnd + 1}", flush=True)
            cond = RoundConditions(busy=busy_processes(), step_read_rate=read_bandwidth(peer_bytes, 0.3))
            with RunnableSampler() as runnable:
                if side == "llama-bench":
                    fig: dict[str, Any] = run_llama_bench(bins, gguf, args)
                    versions["llama-bench:"] = bins.describe()
                else:
                    res = run_side(side, job, llama_python or Path())
                    fig = round_figures(res)
            cond.runnable_mean, cond.steal = runnable.mean, runnable.steal
            if side == "servelab":
                weights["servelab"] = step_read_bytes("servelab-blocks", 0, gguf, res.get("step_bytes"))["bytes"]
                step_bytes["servelab"] = _plus(weights["servelab"], kv)
            if side == "llamacpp":
                versions["llama-cpp-python"] = res.get("version", "?")
            rounds.append({"round": rnd, "side": side, **fig, "conditions": cond.as_dict()})
            ttft = f"{fig['ttft_ms']:.1f} ms" if fig.get("ttft_ms") is not None else "n/a (tg only)"
            print(f"  TPOT p50 {fig['tpot_ms']:.2f} ms  TTFT p50 {ttft}", flush=True)
    rates_after = read_rates(step_bytes.values())
    rates = floor_rates(step_bytes, rates_before, rates_after)
    summary = summarize(rounds, step_bytes, rates, args.rounds)
    summary["step_bytes"] = {"weights": weights, "kv": kv}
    print()
    from engine.kernels.cpu_extension import cflags

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; flags: {format_flags(cpu_flags())}; torch {torch.__version__}; "
          f"servelab's kernels built with {' '.join(cflags())}, dtype {args.dtype}; "
          + "; ".join(f"{k} {v}" for k, v in versions.items()))  # fmt: skip
    print(f"workload: {args.prompts} prompts (+{args.warmup} warm-up) x {args.input_len} random tokens, {args.output_len} "
          f"output tokens, greedy, EOS ignored, batch 1, {args.threads} threads, the same GGUF ({gguf.name}); "
          f"{args.rounds} rounds ABBA, a fresh process per side and round")  # fmt: skip
    if "llama-bench" in peers_here:
        print("llama-bench: " + " ".join(llama_bench_command(bins, gguf, args.input_len, args.output_len, args.threads,
                                                              args.llama_bench_reps))
              + " (tg at the measured depth; TPOT = 1000 / its mean tokens/s; no TTFT)")  # fmt: skip
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
    present = ["servelab", *(s for s in PEERS if any(r["side"] == s for r in rounds))]
    by = {s: [next((r for r in rounds if r["side"] == s and r["round"] == k), None) for k in range(n)]
          for s in present}  # fmt: skip
    out: dict[str, Any] = {"sides": {}, "ratio": {}, "ratios": {}}
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
    for peer in present[1:]:
        out["ratios"][peer] = {key: ratio_spread([r.get(key) if r else None for r in by["servelab"]],
                                                 [r.get(key) if r else None for r in by[peer]])
                               for key in ("tpot_ms", "ttft_ms")}  # fmt: skip
    out["ratio"] = out["ratios"].get("llamacpp", {})  # the in-process pair's (the key earlier summaries had)
    return out


def format_summary(summary: dict[str, Any]) -> list[str]:
    lines = [f"  {'side':<17} {'TPOT p50 ms':>22} {'TTFT p50 ms':>24} {'step reads':>12} {'DRAM floor ms':>14} "
             f"{'TPOT / DRAM floor':>20} {'cache floor ms':>16} {'TPOT / cache floor':>20}"]  # fmt: skip
    for side, s in summary["sides"].items():
        mb = f"{s['step_bytes'] / 1e6:.1f} MB" if s["step_bytes"] else "n/a"
        floor = f"{s['floor_ms']:.2f} ({s['read_rate'] / 1e9:.0f} GB/s)" if s["floor_ms"] else "n/a"
        mfloor = f"{s['memory_floor_ms']:.2f}" if s["memory_floor_ms"] else "n/a"
        lines.append(f"  {SIDE_LABEL.get(side, side):<17} {format_spread(s['tpot_ms'], '.2f'):>22} "
                     f"{format_spread(s['ttft_ms']):>24} {mb:>12} {mfloor:>14} "
                     f"{format_spread(s['tpot_over_memory_floor'], '.2f') + 'x':>20} {floor:>16} "
                     f"{format_spread(s['tpot_over_floor'], '.2f') + 'x':>20}")  # fmt: skip
        lines.append(f"  {'':<17} {format_cv(s['tpot_ms']):>22} {format_cv(s['ttft_ms']):>24}")
    for side, s in summary["sides"].items():
        lines += ["  " + line for line in format_slow_rounds(SIDE_LABEL.get(side, side), s.get("slow_rounds", []))]
    for peer, r in summary.get("ratios", {"llamacpp": summary["ratio"]}).items():
        lines.append(f"  servelab / {SIDE_LABEL.get(peer, peer)}, same round: TPOT {format_spread(r['tpot_ms'], '.2f')}x"
                     + (f", TTFT {format_spread(r['ttft_ms'], '.2f')}x" if r["ttft_ms"]["n"] else ""))  # fmt: skip
    lines.append("  DRAM floor: the step's bytes read at the rate beyond every cache (the machine-independent bar); "
                 "cache floor: at the rate a buffer of the step's size reads (the last-level cache's, where it holds "
                 "the step)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
