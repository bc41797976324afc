"""Online serving throughput and latency of servelab-serve, side by side with vLLM's CPU build.

    python benchmarks/serving_throughput.py [--peer vllm|none] [--concurrency 1,16] [--num-requests 64]
        [--num-requests-c1 16] [--input-len 128] [--output-len 128] [--repeats 1]
        [--dtype D] [--vllm-dtype bfloat16|float32] [--no-vllm-bench] [--json OUT] [servelab overrides...]

Workload (issue 11): `num_requests` requests of `input_len` random prompt token ids (seeded;
the same ids for both servers, sent as token-id prompts to /v1/completions) and `output_len`
output tokens each, greedy, ignore_eos, streamed; all sent at once behind a client-side
concurrency limit (vLLM's `--max-concurrency`), at each `--concurrency`. At concurrency 1
`--num-requests-c1` requests (one at a time takes long: 128 tokens each).

The servers run in turn, never both at once, on the same cores: `servelab-serve` (its own
defaults plus any overrides given) and, with `--peer vllm`, vLLM's OpenAI server from the side
venv (`python -m vllm.entrypoints.openai.api_server`, model from the HF folder that
scripts/peers.sh converts from the same GGUF, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: its model on
every core). The client is the workbench's own driver (workloads.driver with the `openai`
target). `--repeats N` alternates the servers N times.

Also: `vllm bench serve` (from the side venv, unchanged) against servelab-serve at the highest
concurrency; per server the CPU time of its API process and of its engine process per output
token (psutil, over each measured run): where the time goes; and at concurrency 1, TPOT p50
against the batch-1 weight-read time (matmul weights in the serving dtype / memory bandwidth
measured in this run) and, where servelab's small steps read the GGUF checkpoint's own Q4_1 /
Q8_0 blocks (`model.quantized_decode`, its start-up log says so and how many bytes), against
the read time of those bytes too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_throughput import DTYPES, gemm_flops, gemm_shapes, matmul_params  # noqa: E402
from peers import (  # noqa: E402
    DTYPE_BYTES,
    ROOT,
    Peer,
    cpu_flags,
    cpu_model,
    ensure_peers,
    format_flags,
    free_port,
    memory_bandwidth,
)

from engine.config import ModelConfig  # noqa: E402
from workloads.driver import run_workload  # noqa: E402
from workloads.metrics import summarize  # noqa: E402
from workloads.spec import RequestSpec  # noqa: E402
from workloads.targets.openai import OpenAITarget  # noqa: E402

MODEL_NAME = "smollm2"
# servelab's start-up log line when its decode steps read the GGUF checkpoint's own blocks
DECODE_READ = re.compile(r"read the checkpoint's own blocks: ([0-9.]+) MB a step")
READY_TIMEOUT_S = 600.0
SEED = 11


# ---- servers -----------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    proc: subprocess.Popen | None = None
    start_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} during start-up; "
                                 f"its log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        self.start_s = time.perf_counter() - t0
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.name} not ready after {READY_TIMEOUT_S:.0f} s; its log:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) so far: the API process, and all its descendants (the engine)."""
        assert self.proc is not None
        try:
            top = psutil.Process(self.proc.pid)
            kids = top.children(recursive=True)
        except psutil.NoSuchProcess:
            return {"api": 0.0, "engine": 0.0}
        own = top.cpu_times()
        engine = 0.0
        for kid in kids:
            try:
                t = kid.cpu_times()
                engine += t.user + t.system
            except psutil.NoSuchProcess:
                continue
        return {"api": own.user + own.system, "engine": engine}


def servelab_server(tmp: Path, overrides: list[str]) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "engine.entrypoints.serve", "--port", str(port), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return Server("servelab", cmd, env, tmp / "servelab.log", port)


def vllm_server(tmp: Path, peer: Peer, dtype: str, max_num_seqs: int) -> Server:
    port = free_port()
    cmd = [
        str(peer.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(peer.model_dir),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), "--seed", "0",
    ]
    return Server(f"vllm-{dtype}", cmd, peer.env(), tmp / f"vllm-{dtype}.log", port)


# ---- workload ----------------------------------------------------------------------------
def random_prompts(num: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """`num` prompts of `length` uniformly random token ids below `vocab` (no special tokens)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1000, vocab, size=(num, length)).tolist()


def specs_for(prompts: list[list[int]], output_len: int, tag: str) -> list[RequestSpec]:
    return [RequestSpec(f"{tag}-{i}", 0.0, None, p, len(p), output_len, ignore_eos=True)
            for i, p in enumerate(prompts)]


@dataclass
class Measured:
    server: str
    concurrency: int
    summary: dict[str, Any]
    cpu_api_s: float
    cpu_engine_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        s, out = self.summary, max(self.summary["total_output_tokens"], 1)
        return {
            "server": self.server, "concurrency": self.concurrency, "completed": s["completed"],
            "failed": s["failed"], "output_throughput": s["output_throughput"],
            "median_ttft_ms": s["median_ttft_ms"], "median_tpot_ms": s["median_tpot_ms"],
            "median_itl_ms": s["median_itl_ms"], "duration_s": s["duration"],
            "api_cpu_ms_per_token": 1000 * self.cpu_api_s / out, "engine_cpu_ms_per_token": 1000 * self.cpu_engine_s / out,
            **self.extra,
        }


def drive(server: Server, prompts: list[list[int]], output_len: int, concurrency: int, tag: str) -> Measured:
    target = OpenAITarget(server.url, MODEL_NAME, extra_body={"temperature": 0.0})
    cpu0 = server.cpu_seconds()
    res = asyncio.run(run_workload(specs_for(prompts, output_len, tag), target, concurrency=concurrency))
    cpu1 = server.cpu_seconds()
    summary = summarize(res.records)
    if summary["failed"]:
        print(f"  [{server.name}] {summary['failed']} requests failed: {summary['errors']}", flush=True)
    return Measured(server.name, concurrency, summary, cpu1["api"] - cpu0["api"], cpu1["engine"] - cpu0["engine"])


def vllm_bench_serve(peer: Peer, server: Server, args: argparse.Namespace, concurrency: int, tmp: Path) -> dict:
    """`vllm bench serve` (random dataset) against `server`; its result JSON, or {"error": ...}."""
    name = f"bench-{server.name}-c{concurrency}.json"
    cmd = [
        str(peer.python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
        "--base-url", server.url, "--endpoint", "/v1/completions", "--model", MODEL_NAME,
        "--tokenizer", str(peer.model_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_requests), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--seed", str(SEED), "--save-result", "--result-dir", str(tmp), "--result-filename", name,
    ]
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        done = subprocess.run(cmd, cwd=tmp, env=peer.env(), stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    path = tmp / name
    if done.returncode != 0 or not path.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        return {"error": f"vllm bench serve exited with {done.returncode}:\n{tail}"}
    return json.loads(path.read_text())


def warm_up(server: Server, prompts: list[list[int]]) -> None:
    drive(server, prompts[:4], 8, 4, "warm")


def run_server(server: Server, prompts: list[list[int]], args: argparse.Namespace, peer: Peer | None,
               tmp: Path, rep: int) -> list[Measured]:
    print(f"[{server.name}] starting (repeat {rep + 1})", flush=True)
    server.start()
    print(f"[{server.name}] ready after {server.start_s:.0f} s", flush=True)
    read = DECODE_READ.search(server.log_path.read_text(errors="replace")) if server.name == "servelab" else None
    out = []
    try:
        warm_up(server, prompts)
        for c in args.concurrency:
            n = args.num_requests_c1 if c == 1 else args.num_requests
            m = drive(server, prompts[:n], args.output_len, c, f"r{rep}c{c}")
            m.extra["repeat"] = rep
            if read is not None:  # the engine's small steps read the checkpoint's own blocks (its log says)
                m.extra["decode_read_bytes"] = float(read.group(1)) * 1e6
            out.append(m)
            r = m.row()
            print(f"  c={c:<3} {r['output_throughput']:7.1f} out tok/s  TTFT p50 {r['median_ttft_ms']:8.1f} ms  "
                  f"TPOT p50 {r['median_tpot_ms']:7.2f} ms  CPU ms/token: API {r['api_cpu_ms_per_token']:.2f}, "
                  f"engine {r['engine_cpu_ms_per_token']:.2f}", flush=True)
        if peer is not None and server.name == "servelab" and args.vllm_bench:
            c = max(args.concurrency)
            res = vllm_bench_serve(peer, server, args, c, tmp)
            m = Measured("servelab (vllm bench serve)", c, {}, 0.0, 0.0, {"repeat": rep, "vllm_bench": res})
            out.append(m)
            if "error" in res:
                print(f"  vllm bench serve against servelab FAILED: {res['error']}", flush=True)
            else:
                print(f"  vllm bench serve c={c}: {res['output_throughput']:.1f} out tok/s  TTFT p50 "
                      f"{res['median_ttft_ms']:.1f} ms  TPOT p50 {res['median_tpot_ms']:.2f} ms  "
                      f"({res['completed']} completed)", flush=True)
    finally:
        server.stop()
    return out


# ---- driver ------------------------------------------------------------------------------
def servelab_dtype(args: argparse.Namespace, peaks: dict[str, float]) -> str:
    """The dtype servelab-serve runs in: as servelab-serve resolves its config (with this run's
    overrides; `dtype=auto` on a CPU follows `platform.serving_cpu_dtype`); where that fails,
    `--dtype`, else the dtype of the faster GEMM."""
    try:
        from workloads.serve import load_config

        return load_config(list(args.overrides))[0].model.dtype
    except (Exception, SystemExit):  # the server itself reports a bad config; the figures need a dtype
        dtype = args.dtype or ModelConfig().dtype
        return max(peaks, key=peaks.__getitem__) if dtype == "auto" else dtype


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=["vllm", "none"], default="vllm")
    p.add_argument("--concurrency", type=_int_list, default=[1, 16], help="comma-separated, e.g. 1,16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-requests-c1", type=int, default=16, help="requests at concurrency 1")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds of both servers")
    p.add_argument("--dtype", default=None, help="servelab's model.dtype (default: the engine's default)")
    p.add_argument("--vllm-dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--vllm-max-num-seqs", type=int, default=128)
    p.add_argument("--no-vllm-bench", dest="vllm_bench", action="store_false",
                   help="skip `vllm bench serve` against servelab-serve")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the server logs to this folder")
    args, overrides = p.parse_known_args(argv)
    if args.dtype:
        overrides.append(f"model.dtype={args.dtype}")
    args.overrides = overrides
    return args


def measure_machine(arch: Any, batch: int) -> dict[str, Any]:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    return {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0)),
        "gemm_flops": {name: gemm_flops(gemm_shapes(arch, batch), dt) for name, dt in DTYPES.items()},
        "memory_bandwidth": memory_bandwidth(),
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds through `finally`: servers are stopped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from engine.model.loader import resolve_model

    arch = resolve_model(ModelConfig())[0]
    peer = ensure_peers() if args.peer == "vllm" else None
    machine = measure_machine(arch, max(args.concurrency))
    prompts = random_prompts(max(args.num_requests, args.num_requests_c1), args.input_len, arch.vocab_size)
    results: list[Measured] = []
    tmp = Path(tempfile.mkdtemp(prefix="servelab-serving-bench-"))
    try:
        for rep in range(args.repeats):
            results += run_server(servelab_server(tmp, args.overrides), prompts, args, peer, tmp, rep)
            if peer is not None:
                server = vllm_server(tmp, peer, args.vllm_dtype, args.vllm_max_num_seqs)
                results += run_server(server, prompts, args, None, tmp, rep)
    finally:
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for f in tmp.iterdir():
                shutil.copy(f, args.keep_logs / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
    res = summarize_all(args, arch, machine, results)
    report(res)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2, default=str))


def summarize_all(args: argparse.Namespace, arch: Any, machine: dict, results: list[Measured]) -> dict[str, Any]:
    dtype = servelab_dtype(args, machine["gemm_flops"])
    weight_bytes = matmul_params(arch) * DTYPE_BYTES[dtype]
    out: dict[str, Any] = {
        "workload": {"num_requests": args.num_requests, "num_requests_c1": args.num_requests_c1,
                     "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency},
        "machine": machine, "servelab_dtype": dtype, "servelab_overrides": args.overrides,
        "vllm_dtype": args.vllm_dtype if args.peer == "vllm" else None,
        "weight_bytes": weight_bytes, "batch1_weight_read_ms": 1000 * weight_bytes / machine["memory_bandwidth"],
        "runs": [m.row() for m in results if m.summary],
        "vllm_bench_serve": [{"repeat": m.extra["repeat"], "concurrency": m.concurrency, **_bench_row(m.extra["vllm_bench"])}
                             for m in results if "vllm_bench" in m.extra],
    }
    ratios: dict[str, Any] = {}
    for c in args.concurrency:
        sl = [m.row() for m in results if m.server == "servelab" and m.concurrency == c]
        vl = [m.row() for m in results if m.server.startswith("vllm") and m.concurrency == c]
        if sl and vl:
            ratios[str(c)] = {
                key: [a[key] / b[key] if b[key] else None for a, b in zip(sl, vl, strict=False)]
                for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms")
            }
    out["ratios_servelab_over_vllm"] = ratios
    return out


def _bench_row(res: dict) -> dict:
    if "error" in res:
        return {"error": res["error"]}
    keys = ("completed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")
    return {k: res.get(k) for k in keys}


def report(res: dict) -> None:
    m, w = res["machine"], res["workload"]
    print()
    print(f"CPU: {m['cpu']}, {m['cores']} cores; flags: {format_flags(m['cpu_flags'])}")
    print("GEMM peak (torch.mm, model shapes): " + ", ".join(
        f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in m["gemm_flops"].items())
        + f"; memory read bandwidth {m['memory_bandwidth'] / 1e9:.1f} GB/s")
    print(f"workload: {w['num_requests']} requests (c=1: {w['num_requests_c1']}) x {w['input_len']} random prompt "
          f"tokens + {w['output_len']} output tokens, ignore_eos, greedy; servelab dtype {res['servelab_dtype']}"
          + (f", vLLM dtype {res['vllm_dtype']}" if res["vllm_dtype"] else "")
          + (f"; servelab overrides: {' '.join(res['servelab_overrides'])}" if res["servelab_overrides"] else ""))
    print(f"{'server':<12}{'conc':>5}{'out tok/s':>11}{'TTFT p50':>11}{'TPOT p50':>11}{'API CPU':>10}{'engine CPU':>12}"
          "   (latency in ms; CPU in ms per output token)")
    for r in res["runs"]:
        print(f"{r['server']:<12}{r['concurrency']:>5}{r['output_throughput']:>11.1f}{r['median_ttft_ms']:>11.1f}"
              f"{r['median_tpot_ms']:>11.2f}{r['api_cpu_ms_per_token']:>10.2f}{r['engine_cpu_ms_per_token']:>12.2f}"
              + (f"   ({r['failed']} failed)" if r["failed"] else ""))
    for c, ratio in res["ratios_servelab_over_vllm"].items():
        def fmt(xs: list) -> str:
            vals = [x for x in xs if x is not None]
            return f"{statistics.median(vals):.2f} ({', '.join(f'{x:.2f}' for x in vals)})" if vals else "n/a"
        print(f"servelab / vLLM at c={c}: output throughput {fmt(ratio['output_throughput'])}, "
              f"TTFT p50 {fmt(ratio['median_ttft_ms'])}, TPOT p50 {fmt(ratio['median_tpot_ms'])}")
    c1 = [r for r in res["runs"] if r["server"] == "servelab" and r["concurrency"] == 1]
    if c1:
        tpot = statistics.median(r["median_tpot_ms"] for r in c1)
        wr = res["batch1_weight_read_ms"]
        print(f"servelab c=1: TPOT p50 {tpot:.2f} ms against the batch-1 weight-read time {wr:.2f} ms "
              f"({res['weight_bytes'] / 1e6:.0f} MB of {res['servelab_dtype']} weights at "
              f"{m['memory_bandwidth'] / 1e9:.1f} GB/s): {tpot / wr:.2f}x")
        read = [r["decode_read_bytes"] for r in c1 if r.get("decode_read_bytes")]
        if read:  # model.quantized_decode: fewer bytes than the dtype's; their own read time too
            rd = 1000 * read[0] / m["memory_bandwidth"]
            print(f"  its batch-1 steps read the checkpoint's own Q4_1 / Q8_0 blocks, {read[0] / 1e6:.0f} MB (the "
                  f"server's log): {rd:.2f} ms at the same bandwidth, TPOT p50 {tpot / rd:.2f}x that")
    for b in res["vllm_bench_serve"]:
        if "error" in b:
            print(f"vllm bench serve against servelab-serve: FAILED\n{b['error']}")
        else:
            print(f"vllm bench serve against servelab-serve, c={b['concurrency']}: {b['output_throughput']:.1f} out tok/s, "
                  f"TTFT p50 {b['median_ttft_ms']:.1f} ms, TPOT p50 {b['median_tpot_ms']:.2f} ms "
                  f"({b['completed']} completed)")


if __name__ == "__main__":
    main()
