"""A decode step's linears on the checkpoint's own blocks against the bfloat16 kernel, per row count.

    python benchmarks/quant_linears.py [--rows 1,2,4,6,8,10,12,16] [--repeats 25] [--threads N]
        [--part all|layers|head]

Loads the default model (SmolLM2-135M, bfloat16, prepacked: `model.prepack()`), then for each row
count runs what a step's linears run, back to back as a step runs them: every layer's qkv, o,
fused gate/up + SiLU-mul and down projections, then the LM head's argmax, once on the bfloat16
packs (`amx_linear.pack`) and once on the GGUF blocks (`amx_linear.quant_pack`), the two
alternated in one process (median of `--repeats` each). The weights come from memory, as in a
step (120 matrices and the head are ~96 MB as blocks, ~270 MB as bfloat16). Prints ms per step
and the ratio. `--part layers` times the 120 layer matrices alone, `--part head` the head alone:
where each stops winning is `amx_linear.QUANT_MAX_ROWS` (per block kind: the layers Q4_1, the head Q8_0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.kernels import amx_linear  # noqa: E402
from engine.kernels.isa import BF16_CPU_FLAGS, cpu_flags  # noqa: E402
from engine.model.loader import load_model  # noqa: E402


def step_linears(ops, mats: list[tuple[torch.Tensor, ...]], head: torch.Tensor | None, sizes: dict,
                 x: torch.Tensor) -> None:
    """One step's linears on `mats` (qkv, o, gate_up, down per layer) and the head's argmax (if any)."""
    hidden, qkv_n, inter, vocab = sizes["hidden"], sizes["qkv"], sizes["inter"], sizes["vocab"]
    xi = x.new_zeros(x.shape[0], inter).normal_()
    for qkv, o, gate_up, down in mats:
        ops.amx_linear(x, qkv, qkv_n)
        ops.amx_linear(x, o, hidden)
        ops.amx_linear_silu_mul(x, gate_up, inter)
        ops.amx_linear(xi, down, hidden)
    if head is not None:
        ops.amx_linear_argmax(x, head, vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,6,8,10,12,16")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--part", choices=("all", "layers", "head"), default="all")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not amx_linear.quant_available():
        sys.exit("quant_linears: the block kernels need AVX512-BF16 (this CPU or build has none)")
    model = load_model(ModelConfig(dtype="bfloat16"), TorchAttentionBackend(), "cpu")
    model.prepack()
    plan = model.model.plan
    if plan is None or not plan.quant or model.quant_lm_head is None:
        sys.exit("quant_linears: the model's plan has no quant packs (model.quantized_decode, a GGUF checkpoint)")
    ops = amx_linear.amx_ops()
    arch = model.arch
    sizes = {"hidden": arch.hidden_size, "inter": arch.intermediate_size, "vocab": arch.vocab_size,
             "qkv": arch.hidden_size + 2 * arch.num_kv_heads * arch.head_dim}
    layers = args.part != "head"
    bf16 = [lp.amx.matrices(False) for lp in plan.layers] if layers else []
    quant = [lp.amx.matrices(True) for lp in plan.layers] if layers else []
    heads = (model.amx_lm_head, model.quant_lm_head) if args.part != "layers" else (None, None)
    flags = sorted(cpu_flags() & {*BF16_CPU_FLAGS, "avx512f", "avx512_vnni", "avx2", "amx_tile"})
    print(f"CPU flags: {' '.join(flags) or '(none of interest)'}; threads {torch.get_num_threads()}")
    print(f"{args.part}: {'the layer matrices' if layers else ''}{' and ' if layers and heads[0] is not None else ''}"
          f"{'the LM head argmax' if heads[0] is not None else ''}")
    print(f"{'rows':>5}{'bfloat16 ms':>13}{'blocks ms':>11}{'blocks faster':>15}")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, arch.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16()
            times: dict[str, list[float]] = {"bf16": [], "quant": []}
            for i in range(args.repeats + 2):
                for name, mats, head in (("bf16", bf16, heads[0]), ("quant", quant, heads[1])):
                    t0 = time.perf_counter()
                    step_linears(ops, mats, head, sizes, x)
                    if i >= 2:  # two warm-up rounds
                        times[name].append(time.perf_counter() - t0)
            b, q = statistics.median(times["bf16"]) * 1e3, statistics.median(times["quant"]) * 1e3
            print(f"{rows:>5}{b:>13.2f}{q:>11.2f}{b / q:>14.2f}x")


if __name__ == "__main__":
    main()
