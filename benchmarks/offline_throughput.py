"""Offline throughput of servelab vs HF transformers on the CPU, read against measured GEMM peak.

    python benchmarks/offline_throughput.py [--num-requests 64] [--prompt-len 128] [--output-len 128]
        [--threads N] [--dtype auto|float32|bfloat16] [--hf-dtype auto|float32|bfloat16]
        [--skip-hf] [--max-num-seqs 128] [--max-num-batched-tokens 2048] [--repeats 1] [--json OUT]
        [--quick] [--enforce-eager true|false|both]

`--enforce-eager false` runs servelab with its compiled forward (engine/worker/compiled.py);
`both` loads an eager and a compiled engine and alternates their timed runs (printed as
`servelab` and `compiled`). Compile time is measured at start-up and printed apart: it is
never inside a throughput figure.

`--quick` is a smoke run (16 requests x 128 prompt + 32 output tokens, one HF batch);
its figures are not the acceptance numbers.

Workload (engine-core issue): `num_requests` prompts of `prompt_len` real-text token ids
(workloads/prompts.py, a different corpus offset each), greedy, ignore_eos, `output_len`
tokens each, on the default model (SmolLM2-135M GGUF).
1. servelab: `LLM.generate` over all requests at once (continuous batching);
2. HF transformers on the same GGUF: static batches of 16, left padding,
   `generate(max_new_tokens=min_new_tokens=output_len, do_sample=False)`.
Both are warmed up before timing and run one after the other in the same process (never
at once). Also measured: GEMM FLOP/s of `torch.mm` on the model's own shapes in fp32 and
bf16; "auto" dtype picks the faster of the two. Printed: output tokens/s of each, the
ratio servelab/HF, and the fraction of the compute limit each reached, where
FLOPs = 2 * matmul params (every Linear incl. the tied LM head, not the embedding lookup)
per token + attention (4 * layers * q_heads * head_dim * context per token).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import ModelConfig  # noqa: E402
from engine.model.arch import ModelArch  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from workloads.prompts import PromptBuilder  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HF_BATCH = 16
OFFSET_STRIDE = 997  # corpus tokens between consecutive prompts' starts


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


def decode_flops(arch: ModelArch, num_requests: int, prompt_len: int, output_len: int) -> float:
    """Spec formula: per output token 2 * params + attention at its context."""
    per_req = sum(2.0 * matmul_params(arch) + attention_flops(arch, prompt_len + j) for j in range(output_len))
    return num_requests * per_req


def total_flops(arch: ModelArch, num_requests: int, prompt_len: int, output_len: int) -> float:
    """Every token forwarded (prompt + output - 1 per request), attention included."""
    fwd = prompt_len + output_len - 1
    per_req = sum(2.0 * matmul_params(arch) + attention_flops(arch, c + 1) for c in range(fwd))
    return num_requests * per_req


# ---- the two engines -------------------------------------------------------------------
def build_prompts(num: int, length: int) -> list[list[int]]:
    from engine.tokenizer import get_tokenizer

    builder = PromptBuilder(get_tokenizer(ModelConfig()))
    return [builder.token_ids(length, i * OFFSET_STRIDE) for i in range(num)]


def make_servelab(args: argparse.Namespace, dtype: str, enforce_eager: bool = True):  # type: ignore[no-untyped-def]
    from engine.llm import LLM

    return LLM(
        model="smollm2",
        dtype=dtype,
        enforce_eager=enforce_eager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        async_scheduling=args.async_scheduling == "on",
    )


def time_servelab(llm, prompts: list[list[int]], output_len: int, dtype: str, name: str = "servelab") -> RunResult:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return RunResult(name, dtype, elapsed, produced)


def make_hf(dtype: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from engine.model.loader import embedded_gguf_path

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: physical cores)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="servelab dtype")
    p.add_argument("--hf-dtype", choices=["auto", *DTYPES], default="auto")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each engine (alternating)")
    p.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 32 output tokens")
    p.add_argument("--enforce-eager", choices=["true", "false", "both"], default="true",
                   help="servelab forward: eager (true), compiled (false), or both alternating")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.output_len = min(args.num_requests, 16), min(args.output_len, 32)
    if args.threads <= 0:
        args.threads = psutil.cpu_count(logical=False) or torch.get_num_threads()
    return args


def run_all(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    from engine.model.loader import resolve_model

    arch = resolve_model(ModelConfig())[0]
    shapes = gemm_shapes(arch, min(args.num_requests, args.max_num_seqs))
    peaks = {name: gemm_flops(shapes, dt) for name, dt in DTYPES.items()}
    prompts = build_prompts(args.num_requests, args.prompt_len)
    warm = prompts[: min(len(prompts), HF_BATCH)]
    s_dtype, h_dtype = pick_dtype(args.dtype, peaks), pick_dtype(args.hf_dtype, peaks)
    engines = {}  # name -> LLM; "servelab" is the eager one unless --enforce-eager false
    compile_s = {}
    for eager in {"true": [True], "false": [False], "both": [True, False]}[args.enforce_eager]:
        name = "compiled" if not eager and args.enforce_eager == "both" else "servelab"
        t0 = time.perf_counter()
        engines[name] = make_servelab(args, s_dtype, enforce_eager=eager)
        compile_s[name] = engines[name].engine_core.executor.compile_time
        print(f"{name}: engine start {time.perf_counter() - t0:.1f} s, of which compile + warm-up "
              f"{compile_s[name]:.1f} s (enforce_eager={eager})")
        engines[name].generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    hf = None
    if not args.skip_hf:
        hf = make_hf(h_dtype)
        hf_generate(hf, warm, 8)
    runs: dict[str, list[RunResult]] = {**{name: [] for name in engines}, "hf": []}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(time_servelab(llm, prompts, args.output_len, s_dtype, name))
        if hf is not None:
            runs["hf"].append(time_hf(hf, prompts, args.output_len, h_dtype))
    del engines, hf
    gc.collect()
    out = summarize(args, arch, peaks, runs)
    out["compile_time_s"] = compile_s
    out["enforce_eager"] = args.enforce_eager
    return out


def summarize(args: argparse.Namespace, arch: ModelArch, peaks: dict[str, float], runs: dict) -> dict:
    work = (args.num_requests, args.prompt_len, args.output_len)
    flops = {"decode_spec": decode_flops(arch, *work), "all_tokens": total_flops(arch, *work)}
    out: dict = {
        "workload": dict(zip(("num_requests", "prompt_len", "output_len"), work, strict=True)),
        "threads": args.threads,
        "gemm_flops": peaks,
        "matmul_params": matmul_params(arch),
        "runs": {k: [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in v] for k, v in runs.items()},
    }
    for name, rs in runs.items():
        if not rs:
            continue
        secs = statistics.median(r.seconds for r in rs)
        peak = peaks[rs[0].dtype]
        out[name] = {
            "dtype": rs[0].dtype,
            "tokens_per_s": rs[0].output_tokens / secs,
            "compute_fraction_decode_spec": flops["decode_spec"] / secs / peak,
            "compute_fraction_all_tokens": flops["all_tokens"] / secs / peak,
        }
    if runs["hf"]:
        ratios = [s.seconds and h.seconds / s.seconds for s, h in zip(runs["servelab"], runs["hf"], strict=True)]
        out["ratio_servelab_over_hf"] = statistics.median(ratios)
        out["ratios"] = ratios
    if runs["servelab_async"]:
        pairs = zip(runs["servelab"], runs["servelab_async"], strict=True)
        ab = [s.seconds / a.seconds for s, a in pairs]
        out["ratio_async_over_sync"] = statistics.median(ab)
        out["ratios_async_over_sync"] = ab
    out["async_scheduling"] = args.async_scheduling
    return out


def report(res: dict) -> None:
    w = res["workload"]
    print(f"workload: {w['num_requests']} requests x {w['prompt_len']} prompt + {w['output_len']} output tokens, "
          f"greedy, ignore_eos; threads={res['threads']}")
    print("GEMM peak (torch.mm, model shapes): "
          + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in res["gemm_flops"].items()))
    print(f"matmul params per token: {res['matmul_params'] / 1e6:.1f} M")
    for name in ("servelab", "compiled", "hf"):
        if name in res:
            r = res[name]
            print(f"{name:9s} [{r['dtype']}]: {r['tokens_per_s']:8.1f} output tok/s   compute limit reached: "
                  f"{100 * r['compute_fraction_decode_spec']:.1f}% (decode formula), "
                  f"{100 * r['compute_fraction_all_tokens']:.1f}% (prefill+decode)")
    if "ratio_servelab_over_hf" in res:
        each = ", ".join(f"{x:.2f}" for x in res["ratios"])
        print(f"servelab / HF: {res['ratio_servelab_over_hf']:.2f}x (median of runs: {each})")
    if "compiled" in res:
        ratios = [e["seconds"] / c["seconds"] for e, c in zip(res["runs"]["servelab"], res["runs"]["compiled"],
                                                               strict=True)]
        print(f"compiled / eager: {statistics.median(ratios):.2f}x (per alternating pair: "
              + ", ".join(f"{x:.2f}" for x in ratios) + ")")
    for name, secs in res.get("compile_time_s", {}).items():
        if secs:
            print(f"{name}: compile + warm-up at start-up {secs:.1f} s (not in any figure above)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res = run_all(args)
    report(res)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
