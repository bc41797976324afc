"""llama.cpp's side of benchmarks/c1_inprocess.py: batch-1 greedy decode in process, timed per token.

Runs in llama-cpp-python's side venv (`make peers-llamacpp`), so it imports nothing of servelab
(that venv has no torch). Reads a JSON job on stdin: {"model": GGUF path, "threads": n,
"prompts": [[token ids], ...], "output_len": n, "warmup": n}; prints one JSON object: per prompt
the seconds to the first token and the times of every token after it.

Each prompt: `Llama.generate` from a reset context (the prompt evaluated in one batch), greedy
(temperature 0: llama.cpp's greedy sampler; no top-k / top-p / min-p / repetition penalty), the
first `output_len` tokens taken whatever they are (an EOS does not stop it), so both engines
decode the same number of tokens from the same ids.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=job["model"], n_ctx=2048, n_batch=512, n_threads=job["threads"],
                n_threads_batch=job["threads"], verbose=False)  # fmt: skip

    def one(prompt: list[int]) -> dict[str, object]:
        times: list[float] = []
        t0 = time.perf_counter()
        for _ in llm.generate(prompt, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == job["output_len"]:
                break
        return {"ttft_s": times[0] - t0, "token_times": [t - t0 for t in times]}

    for prompt in job["prompts"][: job["warmup"]]:
        one(prompt)
    out = [one(p) for p in job["prompts"][job["warmup"] :]]
    print(json.dumps({"version": __version__, "requests": out}))


if __name__ == "__main__":
    main()
