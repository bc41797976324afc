"""Offline throughput of servelab vs vLLM's CPU build and HF transformers, read against measured GEMM peak.

    python benchmarks/offline_throughput.py [--peer vllm|none] [--num-requests 64]
        [--min-prompt-len 96] [--max-prompt-len 160] [--prompt-len N] [--output-len 128]
        [--threads N] [--dtype auto|float32|bfloat16] [--enforce-eager true|false]
        [--async-scheduling true|false] [--vllm-dtypes bfloat16 float32] [--hf-dtype auto|float32|bfloat16]
        [--skip-hf] [--max-num-seqs 128] [--max-num-batched-tokens 2048] [--repeats 2] [--json OUT] [--quick]

`--quick` is a smoke run (16 requests, 32 output tokens, one HF batch); its figures are not
the acceptance numbers.

Workload W (issue 11): `num_requests` prompts of real-text token ids (workloads/prompts.py, a
different corpus offset each) whose lengths are drawn uniformly from [min, max] prompt tokens
(seeded), greedy, ignore_eos, `output_len` tokens each, on the default model (SmolLM2-135M GGUF).
1. servelab: `LLM.generate` over all requests at once (continuous batching), in this process;
   `--dtype`, `--enforce-eager` and `--async-scheduling` go to the engine (an option the engine
   of this branch does not know is reported and ignored);
2. `--peer vllm`: vLLM's CPU build (scripts/peers.sh installs it in a side venv; the script runs
   it when missing), `LLM.generate` over the same token ids in a subprocess of that venv
   (benchmarks/vllm_offline_worker.py), on the same cores (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`),
   once per `--vllm-dtypes` entry (default bfloat16 only: servelab's dtype). Like for like: both
   get the same `--max-num-seqs` and `--max-num-batched-tokens`, and servelab runs
   `quantized_decode=False` against it, so both multiply the bfloat16 weights the GGUF
   dequantizes to (servelab's block kernels read the GGUF's own blocks: llama.cpp's weights);
3. HF transformers on the same GGUF (unless `--skip-hf`): static batches of 16, left padding,
   `generate(max_new_tokens=min_new_tokens=output_len, do_sample=False)`.
Every engine is built and warmed up before timing (start-up and compilation are never timed);
the timed runs alternate in ABBA order (servelab first in rounds 1, 3, ..., last in rounds 2, 4,
...), `--repeats` rounds (3 or more for a figure to quote), never two at once; each figure is the
median of the rounds with their range. Also measured in the same run: a reference, `torch.mm` on
the model's own shapes at the run's batch in fp32 and bf16 (named for what it is: not the machine's
compute limit), and the CPU flags (avx512_bf16, amx_bf16). Printed: output tokens/s of each
engine, the ratio servelab / vLLM (median of same-round ratios, and their range), servelab / HF,
and the fraction of the torch.mm reference each reached, where FLOPs = 2 * matmul params (every
Linear incl. the tied LM head, not the embedding lookup) per token + attention (4 * layers *
q_heads * head_dim * context per token).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers import Peer, cpu_flags, cpu_model, ensure_peers, format_flags  # noqa: E402

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.model.arch import ModelArch  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from workloads.prompts import PromptBuilder  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HF_BATCH = 16
OFFSET_STRIDE = 997  # corpus tokens between consecutive prompts' starts
PROMPT_SEED = 11
# Engine options that other branches add; passed only where this branch's EngineConfig knows them.
OPTIONAL_ENGINE_FIELDS = ("enforce_eager", "async_scheduling")
VLLM_READY_TIMEOUT_S = 900.0


@dataclass
class RunResult:
    name: str
    dtype: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- hardware peak ---------------------------------------------------------------------
def gemm_shapes(arch: ModelArch, batch: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's GEMMs at `batch` rows: QKV, O, gate_up, down, LM head."""
    h, i = arch.hidden_size, arch.intermediate_size
    return [
        (batch, h, arch.q_size + 2 * arch.kv_size),
        (batch, arch.q_size, h),
        (batch, h, 2 * i),
        (batch, i, h),
        (batch, h, arch.vocab_size),
    ]


def gemm_flops(shapes: list[tuple[int, int, int]], dtype: torch.dtype, min_s: float = 0.3) -> float:
    """Best FLOP/s of `torch.mm` over `shapes` (each timed for at least `min_s` after a warm-up)."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        torch.mm(a, b, out=out)
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_s:
            torch.mm(a, b, out=out)
            reps += 1
        best = max(best, 2.0 * m * k * n * reps / elapsed)
    return best


# ---- FLOP model ------------------------------------------------------------------------
def matmul_params(arch: ModelArch) -> int:
    """Weights multiplied per token: every Linear of every layer plus the LM head."""
    h, per_layer = arch.hidden_size, 0
    per_layer += h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h  # qkv, o
    experts = max(arch.num_experts_per_tok, 1) if arch.is_moe else 1
    per_layer += experts * 3 * h * arch.intermediate_size  # gate, up, down
    return arch.num_layers * per_layer + arch.vocab_size * h


def attention_flops(arch: ModelArch, context: int) -> float:
    """QK^T and PV FLOPs of one token attending to `context` positions, all layers."""
    return 4.0 * arch.num_layers * arch.num_heads * arch.head_dim * context


def decode_flops(arch: ModelArch, prompt_lens: list[int], output_len: int) -> float:
    """Spec formula: per output token 2 * params + attention at its context."""
    return sum(
        sum(2.0 * matmul_params(arch) + attention_flops(arch, p + j) for j in range(output_len)) for p in prompt_lens
    )


def total_flops(arch: ModelArch, prompt_lens: list[int], output_len: int) -> float:
    """Every token forwarded (prompt + output - 1 per request), attention included."""
    return sum(
        sum(2.0 * matmul_params(arch) + attention_flops(arch, c + 1) for c in range(p + output_len - 1))
        for p in prompt_lens
    )


# ---- workload --------------------------------------------------------------------------
def prompt_lengths(num: int, lo: int, hi: int, seed: int = PROMPT_SEED) -> list[int]:
    """`num` prompt lengths drawn uniformly from [lo, hi] (seeded: the same in every run)."""
    return np.random.default_rng(seed).integers(lo, hi + 1, size=num).tolist()


def build_prompts(lengths: list[int]) -> list[list[int]]:
    from engine.tokenizer import get_tokenizer

    builder = PromptBuilder(get_tokenizer(ModelConfig()))
    return [builder.token_ids(n, i * OFFSET_STRIDE) for i, n in enumerate(lengths)]


# ---- servelab --------------------------------------------------------------------------
def engine_option_names() -> set[str]:
    cfg = EngineConfig()
    return {f.name for section in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, section.name))}


def engine_accepts_dtype(dtype: str) -> bool:
    try:
        EngineConfig.from_kwargs(dtype=dtype)
    except ValueError:
        return False
    return True


def servelab_options(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Optional engine options to pass, and a note per option this branch's engine does not know."""
    known, opts, notes = engine_option_names(), {}, []
    for name in OPTIONAL_ENGINE_FIELDS:
        value = getattr(args, name)
        if value is None:
            continue
        if name in known:
            opts[name] = value
        else:
            notes.append(f"--{name.replace('_', '-')} ignored: this branch's engine has no {name!r} option")
    return opts, notes


def make_servelab(args: argparse.Namespace, dtype: str, options: dict[str, Any]):  # type: ignore[no-untyped-def]
    from engine.frontend.llm import LLM

    if "warm_up_linears" in engine_option_names():  # start-up work (oneDNN's kernels) is never timed
        options = {"warm_up_linears": True, **options}
    return LLM(
        model="smollm2",
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        **options,
    )


def time_servelab(llm, prompts: list[list[int]], output_len: int, dtype: str, name: str = "servelab") -> RunResult:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return RunResult(name, dtype, elapsed, produced)


# ---- vLLM (peer venv, subprocess) ------------------------------------------------------
class VllmWorker:
    """One vLLM `LLM` in a subprocess of the peer venv, driven line by line (vllm_offline_worker.py)."""

    def __init__(self, peer: Peer, dtype: str, prompts: list[list[int]], args: argparse.Namespace, tmp: Path) -> None:
        self.dtype, self.name = dtype, f"vllm-{dtype}"
        spec = {
            "model": str(peer.model_dir), "dtype": dtype, "prompts": prompts, "output_len": args.output_len,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": 2048,
        }
        spec_path = tmp / f"{self.name}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = tmp / f"{self.name}.log"
        env = peer.env()  # vLLM binds its own OpenMP threads: every core, none reserved
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(peer.python), str(Path(__file__).with_name("vllm_offline_worker.py")), str(spec_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
            )
        self.ready = self._read(VLLM_READY_TIMEOUT_S)

    def _read(self, timeout_s: float = 1800.0) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise SystemExit(f"{self.name} exited with {self.proc.returncode}; its log:\n{tail}")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except OSError:  # the worker is gone (e.g. the OOM killer): say why, from its log
            return self._read()
        return self._read()

    def time_run(self) -> RunResult:
        res = self.ask("run")
        return RunResult(self.name, self.dtype, res["seconds"], res["output_tokens"])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(SystemExit, OSError, ValueError):
                self.ask("quit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ---- HF transformers -------------------------------------------------------------------
def make_hf(dtype: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from engine.model.source import embedded_gguf_path

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype])
    return model.eval()


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask: [B, Lmax], prompts right-aligned (left padding)."""
    lmax = max(len(p) for p in batch)
    ids = torch.full((len(batch), lmax), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), lmax), dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, lmax - len(p) :] = torch.tensor(p)
        mask[row, lmax - len(p) :] = 1
    return ids, mask


def hf_generate(model, prompts: list[list[int]], output_len: int) -> int:  # type: ignore[no-untyped-def]
    """Greedy generation in static batches of HF_BATCH; returns the output tokens produced."""
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    produced = 0
    with torch.inference_mode():
        for start in range(0, len(prompts), HF_BATCH):
            ids, mask = left_pad(prompts[start : start + HF_BATCH], pad)
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=pad,
            )
            produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced


def time_hf(model, prompts: list[list[int]], output_len: int, dtype: str) -> RunResult:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    produced = hf_generate(model, prompts, output_len)
    return RunResult("hf", dtype, time.perf_counter() - t0, produced)


# ---- driver ----------------------------------------------------------------------------
def pick_dtype(requested: str, peaks: dict[str, float]) -> str:
    return max(peaks, key=peaks.__getitem__) if requested == "auto" else requested


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=["vllm", "none"], default="none", help="also run vLLM's CPU build")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=96)
    p.add_argument("--max-prompt-len", type=int, default=160)
    p.add_argument("--prompt-len", type=int, default=None, help="fixed prompt length (sets min and max)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: physical cores)")
    p.add_argument("--dtype", default="bfloat16", help="servelab dtype: auto, float32 or bfloat16 (vLLM's: --vllm-dtypes)")
    p.add_argument("--enforce-eager", type=_bool, default=None, help="servelab: true/false (where the engine has it)")
    p.add_argument("--async-scheduling", type=_bool, default=None, help="servelab: true/false (where the engine has it)")
    p.add_argument("--vllm-dtypes", nargs="+", choices=list(DTYPES), default=["bfloat16"],
                   help="vLLM runs, one per dtype; the like-for-like figure is the one in servelab's dtype")
    p.add_argument("--hf-dtype", choices=["auto", *DTYPES], default="auto")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, ABBA order (3 or more for a quotable figure)")
    p.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 32 output tokens")
    args = p.parse_args(argv)
    if args.prompt_len is not None:
        args.min_prompt_len = args.max_prompt_len = args.prompt_len
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if args.quick:
        args.num_requests, args.output_len = min(args.num_requests, 16), min(args.output_len, 32)
    if args.threads <= 0:
        args.threads = psutil.cpu_count(logical=False) or torch.get_num_threads()
    return args


def timed_rounds(args: argparse.Namespace, llm, prompts: list[list[int]], s_dtype: str,  # type: ignore[no-untyped-def]
                 workers: list[VllmWorker], hf, h_dtype: str) -> dict[str, list[RunResult]]:
    """`args.repeats` timed rounds, servelab and each vLLM worker in ABBA order, HF last."""
    runs: dict[str, list[RunResult]] = {"servelab": [], "hf": []} | {w.name: [] for w in workers}
    for rnd in range(args.repeats):
        if rnd % 2 == 0:  # ABBA: servelab first in even rounds, last in odd ones
            runs["servelab"].append(time_servelab(llm, prompts, args.output_len, s_dtype))
            print(f"round {rnd + 1}: servelab {runs['servelab'][-1].tokens_per_s:.1f} tok/s", flush=True)
        for w in list(workers):
            try:
                runs[w.name].append(w.time_run())
            except SystemExit as exc:  # e.g. killed by the OOM killer on a crowded machine
                print(f"round {rnd + 1}: {w.name} failed, dropped from the comparison: {exc}", flush=True)
                workers.remove(w)
                continue
            print(f"round {rnd + 1}: {w.name} {runs[w.name][-1].tokens_per_s:.1f} tok/s", flush=True)
        if rnd % 2 == 1:
            runs["servelab"].append(time_servelab(llm, prompts, args.output_len, s_dtype))
            print(f"round {rnd + 1}: servelab {runs['servelab'][-1].tokens_per_s:.1f} tok/s", flush=True)
        if hf is not None:
            runs["hf"].append(time_hf(hf, prompts, args.output_len, h_dtype))
    return runs


def run_all(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    from engine.model.loader import resolve_model

    peer = ensure_peers() if args.peer == "vllm" else None
    arch = resolve_model(ModelConfig())[0]
    shapes = gemm_shapes(arch, min(args.num_requests, args.max_num_seqs))
    peaks = {name: gemm_flops(shapes, dt) for name, dt in DTYPES.items()}
    lengths = prompt_lengths(args.num_requests, args.min_prompt_len, args.max_prompt_len)
    prompts = build_prompts(lengths)
    warm = prompts[: min(len(prompts), HF_BATCH)]
    s_dtype = args.dtype if args.dtype == "auto" and engine_accepts_dtype("auto") else pick_dtype(args.dtype, peaks)
    h_dtype = pick_dtype(args.hf_dtype, peaks)
    options, notes = servelab_options(args)
    if peer is not None and "quantized_decode" in engine_option_names():
        # Like for like: vLLM multiplies the bfloat16 weights the GGUF dequantizes to, so servelab does too
        # (its block kernels read the GGUF's own Q4_1 / Q8_0 blocks; llama.cpp is their peer).
        options["quantized_decode"] = False
    for note in notes:
        print(note, flush=True)
    workers: list[VllmWorker] = []
    tmp = Path(tempfile.mkdtemp(prefix="servelab-offline-bench-"))
    try:
        if peer is not None:  # built first: their start-up (~1-2 min each, compiling) is never timed
            for dt in args.vllm_dtypes:
                print(f"[vllm-{dt}] starting", flush=True)
                workers.append(VllmWorker(peer, dt, prompts, args, tmp))
                workers[-1].ask("warm")
                print(f"[vllm-{dt}] ready after {workers[-1].ready['load_s']:.0f} s", flush=True)
        llm = make_servelab(args, s_dtype, options)
        if s_dtype == "auto":  # figures under the dtype it resolved to (its GEMM peak); the run says why
            s_dtype = llm.config.model.dtype
            why = ""
            if not torch.cuda.is_available():
                from engine.kernels.isa import fastest_cpu_dtype

                why = f" ({fastest_cpu_dtype()[1]})"
            print(f"servelab: dtype auto -> {s_dtype}{why}", flush=True)
        compile_s = float(getattr(llm.engine_core.executor, "compile_time", 0.0) or 0.0)
        if compile_s:
            print(f"servelab: compile + warm-up at start-up {compile_s:.1f} s (never inside a throughput figure)",
                  flush=True)
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        hf = None
        if not args.skip_hf:
            hf = make_hf(h_dtype)
            hf_generate(hf, warm, 8)
        runs = timed_rounds(args, llm, prompts, s_dtype, workers, hf, h_dtype)
        del llm, hf
        gc.collect()
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(args, arch, peaks, lengths, runs, options)


def summarize(args: argparse.Namespace, arch: ModelArch, peaks: dict[str, float], lengths: list[int],
              runs: dict[str, list[RunResult]], options: dict[str, Any]) -> dict:
    flops = {"decode_spec": decode_flops(arch, lengths, args.output_len),
             "all_tokens": total_flops(arch, lengths, args.output_len)}
    out: dict = {
        "workload": {"num_requests": args.num_requests, "min_prompt_len": args.min_prompt_len,
                     "max_prompt_len": args.max_prompt_len, "mean_prompt_len": statistics.mean(lengths),
                     "output_len": args.output_len},
        "threads": args.threads,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "gemm_flops": peaks,
        "gemm_reference": f"torch.mm at batch {min(args.num_requests, args.max_num_seqs)} on the model's shapes",
        "order": "ABBA (servelab first in odd-numbered rounds, last in even-numbered ones)",
        "matmul_params": matmul_params(arch),
        "servelab_options": options,
        "runs": {k: [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in v] for k, v in runs.items()},
        "engines": {},
    }
    for name, rs in runs.items():
        if not rs:
            continue
        secs = statistics.median(r.seconds for r in rs)
        peak = peaks.get(rs[0].dtype, max(peaks.values()))  # an unknown dtype: the faster of the two peaks
        each = [r.tokens_per_s for r in rs]
        out["engines"][name] = {
            "dtype": rs[0].dtype,
            "tokens_per_s": rs[0].output_tokens / secs,
            "tokens_per_s_min": min(each), "tokens_per_s_max": max(each),
            "compute_fraction_decode_spec": flops["decode_spec"] / secs / peak,
            "compute_fraction_all_tokens": flops["all_tokens"] / secs / peak,
        }
    vllm_names = [n for n in runs if n.startswith("vllm-") and runs[n]]
    per_round = []
    for i, s in enumerate(runs["servelab"]):
        done = [n for n in vllm_names if len(runs[n]) > i]  # a worker that died has fewer rounds
        if done:
            best = max(done, key=lambda n, i=i: runs[n][i].tokens_per_s)
            per_round.append((s.tokens_per_s / runs[best][i].tokens_per_s, best))
    if per_round:
        out["ratio_servelab_over_vllm_best"] = statistics.median(r for r, _ in per_round)
        out["ratios_vllm"] = [r for r, _ in per_round]
        out["vllm_best_per_round"] = [n for _, n in per_round]
    if runs["hf"]:
        ratios = [h.seconds / s.seconds for s, h in zip(runs["servelab"], runs["hf"], strict=True)]
        out["ratio_servelab_over_hf"] = statistics.median(ratios)
        out["ratios_hf"] = ratios
    return out


def report(res: dict) -> None:
    w = res["workload"]
    print(f"workload: {w['num_requests']} requests x {w['min_prompt_len']}-{w['max_prompt_len']} prompt tokens "
          f"(mean {w['mean_prompt_len']:.1f}) + {w['output_len']} output tokens, greedy, ignore_eos; "
          f"threads={res['threads']}")
    print(f"CPU: {res['cpu']}; flags: {format_flags(res['cpu_flags'])}")
    ref = res.get("gemm_reference", "torch.mm on the model's shapes")
    print(f"reference: {ref}: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in res["gemm_flops"].items()))
    print(f"order: {res.get('order', 'alternating')}; figures: median (min-max) of the rounds")
    print(f"matmul params per token: {res['matmul_params'] / 1e6:.1f} M"
          + (f"; servelab options: {res['servelab_options']}" if res["servelab_options"] else ""))
    for name, r in res["engines"].items():
        rng = f"{r.get('tokens_per_s_min', r['tokens_per_s']):.1f}-{r.get('tokens_per_s_max', r['tokens_per_s']):.1f}"
        print(f"{name:14s} [{r['dtype']}]: {r['tokens_per_s']:8.1f} output tok/s ({rng})   of the torch.mm "
              f"reference: {100 * r['compute_fraction_decode_spec']:.1f}% (decode formula), "
              f"{100 * r['compute_fraction_all_tokens']:.1f}% (prefill+decode)")
    if "ratio_servelab_over_vllm_best" in res:
        each = ", ".join(f"{x:.2f} vs {n}" for x, n in zip(res["ratios_vllm"], res["vllm_best_per_round"], strict=True))
        lo, hi = min(res["ratios_vllm"]), max(res["ratios_vllm"])
        print(f"servelab / vLLM-best: {res['ratio_servelab_over_vllm_best']:.2f}x ({lo:.2f}-{hi:.2f}; rounds: {each})")
        if res.get("servelab_options", {}).get("quantized_decode") is False:
            print("  same weights: servelab with model.quantized_decode=false (bfloat16 from the same GGUF, as vLLM)")
    if "ratio_servelab_over_hf" in res:
        each = ", ".join(f"{x:.2f}" for x in res["ratios_hf"])
        print(f"servelab / HF: {res['ratio_servelab_over_hf']:.2f}x (median of rounds: {each})")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds through `finally`: vLLM workers are stopped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    res = run_all(args)
    report(res)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
