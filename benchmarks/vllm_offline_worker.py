"""vLLM's `LLM.generate` behind a line protocol; runs in the peer venv (never imports servelab).

    <peer venv>/bin/python benchmarks/vllm_offline_worker.py SPEC.json

SPEC.json: {"model": HF folder, "dtype": "bfloat16"|"float32", "prompts": [[ids...], ...],
"output_len": N, "max_num_seqs": N, "max_num_batched_tokens": N, "max_model_len": N}.
Prints one JSON line {"ready": true, "load_s": ...} once the engine is built (start-up and
compilation are never timed), then answers each stdin line:
    warm  -> generate 8 tokens for the first 16 prompts;   {"warm": true}
    run   -> generate `output_len` tokens for every prompt, greedy, ignore_eos;
             {"seconds": ..., "output_tokens": ..., "first_ids": [...]}
    quit  -> exit
Every other line it prints goes to stderr, so stdout carries only the protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process, like servelab's LLM
    proto = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints must not mix with the protocol
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"], seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    say({"ready": True, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd == "warm":
            llm.generate(prompts[:16], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
            say({"warm": True})
        elif cmd == "run":
            params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
            with contextlib.suppress(Exception):
                llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            say({"seconds": seconds, "output_tokens": produced, "first_ids": list(outs[0].outputs[0].token_ids[:16])})
        else:
            say({"error": f"unknown command {cmd!r}"})


if __name__ == "__main__":
    main()
