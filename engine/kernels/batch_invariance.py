"""`model.batch_invariant`: each row's logits independent of the other rows of its step, and
which weights each step size multiplies (`step_weights`, in the start-up log).

Why it is a switch. On a CPU with AVX512-BF16 and a GGUF checkpoint the engine picks kernels by
how many rows a step has: up to `amx_linear.QUANT_MAX_ROWS` rows (10 for Q4_1, 6 for Q8_0) the
linears multiply the checkpoint's own blocks, past that the loader's bfloat16 rounding of them
(the decode kernels up to `amx_linear.max_rows()`, then oneDNN's, whose sums run in an order of its
own choosing per shape); attention takes prefill paths for a prompt's rows (16-row query
blocks) and a decode path for one-row queries, and splits its work by the step's row count. So
a greedy request's tokens changed with the load beside it: 12 of 20 prompts came out different
alone than in a batch of 16 under a 48-token budget, 10 under the default 2048 (SmolLM2, bfloat16, AMX; tests/test_batch_invariant.py).

What the switch fixes (vLLM's VLLM_BATCH_INVARIANT does the same on a GPU):
- linears and the LM head: the decode kernels' bfloat16 packs at every step size
  (forward_plan.ForwardPlan.batch_invariant); each row sums its own products over the
  reduction in one order whatever rows share its tile or register group (AMX tile rows,
  vdpbf16ps accumulators per row: tests/test_amx_linear.py holds row i of an M-row call to the
  1-row call's bits for M up to 64), greedy steps' argmax fused as before; the quant blocks are
  not read;
- attention: every row, prefill or decode, through one call of the paged op per layer with its
  work split fixed (torch_backend.TorchAttentionBackend.batch_invariant), so how a prompt is
  chunked under a shared token budget does not change its rows either;
- norms, rotary, SiLU: per-row kernels already (engine/kernels/csrc/layer_ops.cpp).
The cost: no quant blocks at small batches, per-row attention for prompts, and the decode
kernels for prefill-sized steps (docs/configuration.md gives the measured figures).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.config import ModelConfig
from engine.kernels import amx_linear, cpu_blocks
from engine.kernels.kernel_choices import block_linear_choice

# The model these functions read (LlamaForCausalLM, engine/model/llama.py, or a family built on
# it): its `model.plan` (forward_plan.ForwardPlan), `amx_lm_head`, `quant_lm_head`,
# `block_lm_head`, `lm_head`, `gguf_path` and `_lm_head_weight()`. The kernels import no model.
CausalLM = Any

logger = logging.getLogger(__name__)


def machine_lacks() -> str | None:
    """What this machine lacks for `model.batch_invariant`'s CPU kernels (None: nothing): the C++
    paged-attention op, and AMX or AVX512-BF16 for the decode kernels."""
    from engine.kernels.paged_attention import paged_attention_op

    if paged_attention_op() is None:
        return "the torch attention backend with its C++ paged-attention op"
    if not amx_linear.available():
        return "a CPU with AMX or AVX512-BF16 for the decode kernels (amx_linear.kind() is 'onednn' here)"
    return None


def require(config: ModelConfig, device: torch.device, dtype: torch.dtype, backend: Any) -> None:
    """Before loading: ValueError naming the first thing `model.batch_invariant` needs that this
    configuration lacks; marks the attention backend batch-invariant otherwise (a backend that
    can be has a `batch_invariant` attribute: the torch backend, with the C++ paged op)."""
    why = None
    if device.type != "cpu" or dtype != torch.bfloat16:
        why = f"bfloat16 on a CPU, not {str(dtype).removeprefix('torch.')} on {device.type}"
    elif not config.enforce_eager:
        why = "enforce_eager (the compiled forward runs inductor's kernels)"
    elif not config.prepack_weights:
        why = "prepack_weights (the decode kernels' packs)"
    elif not hasattr(backend, "batch_invariant"):
        why = "the torch attention backend with its C++ paged-attention op"
    else:
        why = machine_lacks()
    if why is not None:
        raise ValueError(f"model.batch_invariant: needs {why}")
    backend.batch_invariant = True


def check_plan(model: CausalLM) -> None:
    """After packing: ValueError unless every linear and the LM head run the decode kernels."""
    plan = model.model.plan
    if plan is None or not plan.batch_invariant or plan.amx_ops is None or model.amx_lm_head is None:
        raise ValueError("model.batch_invariant: a dense model whose every linear and LM head the decode "
                         "kernels take (amx_linear.supports: K a multiple of 32)")


def step_weights(model: CausalLM) -> dict[str, str]:
    """Which weights the linears multiply, by step size (rows): e.g. {"rows<=6": ..., "rows 7-10":
    ..., "rows>10": "bfloat16 (loader-rounded)"}, or {"all": ...} (batch-invariant, no quant packs)."""
    weight = model._lm_head_weight()
    base = _base(str(weight.dtype).removeprefix("torch."), model.gguf_path is not None)
    plan = model.model.plan
    if plan is not None and plan.quant:
        kinds = {amx_linear.block_kind(t) for lp in plan.layers if lp.amx and lp.amx.quant for t in lp.amx.quant}
        head = model.quant_lm_head
        return _describe(base, kinds, amx_linear.block_kind(head) if head is not None else None, amx_linear.QUANT_MAX_ROWS)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    attached = [m.__dict__.get("gguf_parts") for m in linears]  # cpu_blocks.attach_parts: ((kind, packed), ...)
    kinds = {kind for parts in attached if parts is not None for kind, _ in parts}
    if not kinds or any(b is None for b in attached):
        return {"all": base}  # cpu_blocks reads every dense layer's matrices or none (LlamaForCausalLM._attach_blocks)
    head_kind = model.block_lm_head[0] if model.block_lm_head is not None else None
    return _describe(base, kinds, head_kind, _block_rows())


def planned_step_weights(config: ModelConfig, dtype: str, tensor_types: dict[str, str] | None) -> dict[str, str]:
    """What `step_weights` will say of the model `config` names in `dtype` on this CPU, from its
    GGUF's tensor types (`tensor_types`: GGUF tensor name -> block kind, from the file's metadata,
    no weights read; None where the model is no GGUF file the loader reads as one): for a run's
    summary.json, where the engine may run in another process (engine/model/loader.py's
    `planned_step_weights` reads the types). tests/test_batch_invariant.py holds the two equal."""
    gguf = tensor_types is not None
    base = _base(dtype, gguf)
    if (config.batch_invariant or not config.quantized_decode or not config.prepack_weights or tensor_types is None
            or dtype not in ("bfloat16", "float32")):  # fmt: skip
        return {"all": base}
    choice = block_linear_choice(dtype)
    if choice == "avx512-vnni":
        rows = amx_linear.QUANT_MAX_ROWS
    elif choice in ("avx2", "scalar"):
        rows = _block_rows()
    else:
        return {"all": base}
    kinds = {kind for name, kind in tensor_types.items() if name.startswith("blk.") and name.endswith(_LAYER_MATRICES)}
    if not kinds or not kinds <= set(rows):
        return {"all": base}
    head = tensor_types.get("output.weight", tensor_types.get("token_embd.weight"))
    return _describe(base, kinds, head if head in rows else None, rows)


def _block_rows() -> dict[str, int]:
    """cpu_blocks' row limits by block kind on this CPU (its scalar build: 1 row)."""
    return {kind: cpu_blocks.max_rows(kind) for kind in cpu_blocks.BLOCK_BYTES}


# A GGUF layer's linear matrices (the quant packs need every one of them in a block kind they read).
_LAYER_MATRICES = tuple(f"{m}.weight" for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                               "ffn_down"))  # fmt: skip


def _base(dtype: str, gguf: bool) -> str:
    """The weights the dtype's kernels multiply: a GGUF's are the loader's rounding of its blocks."""
    return f"{dtype} (loader-rounded)" if gguf and dtype != "float32" else dtype


def _describe(base: str, layer_kinds: set[str], head_kind: str | None, rows: dict[str, int]) -> dict[str, str]:
    """Step-size ranges -> weights, the layers reading blocks of `layer_kinds` and the LM head
    blocks of `head_kind` (None: the dense weights always) up to `rows` of their kind."""
    layer_rows = min(rows[k] for k in layer_kinds)
    head_rows = rows[head_kind] if head_kind is not None else 0
    out, lo = {}, 1
    for hi in sorted({layer_rows, head_rows} - {0}):
        layers = f"gguf {'/'.join(sorted(layer_kinds))} blocks" if hi <= layer_rows else base
        lm_head = f"gguf {head_kind} blocks" if head_kind is not None and hi <= head_rows else base
        out[f"rows<={hi}" if lo == 1 else f"rows {lo}-{hi}"] = (
            layers if layers == lm_head else f"layers: {layers}; LM head: {lm_head}")
        lo = hi + 1
    out[f"rows>{lo - 1}"] = base
    return out


def block_step_bytes(model: CausalLM) -> tuple[float, float] | None:
    """(bytes of the checkpoint's own blocks a step of up to `quant_max_rows` rows reads, bytes of
    the bfloat16 packs it would read instead), or None where the model reads no blocks."""
    plan = model.model.plan
    if plan is None or plan.batch_invariant or not plan.quant:
        return None
    quant = [t for lp in plan.layers if lp.amx and lp.amx.quant for t in lp.amx.quant]
    bf16 = [t for lp in plan.layers if lp.amx for t in lp.amx.matrices(False)]
    heads = [(model.quant_lm_head, model.amx_lm_head)] if model.quant_lm_head is not None else []
    read = sum(t.nbytes for t in quant + [q for q, _ in heads])
    full = sum(t.nbytes for t in bf16 + [b for _, b in heads if b is not None])
    return float(read), float(full)


def log_step_weights(model: CausalLM) -> None:
    """The start-up log line of `step_weights`, with a step's weight bytes where quant packs exist."""
    plan = model.model.plan
    line = f"linear weights by step size: {step_weights(model)}"
    if plan is not None and plan.batch_invariant:
        line += " (model.batch_invariant: the same weights and sums at every step size)"
    elif plan is not None and (step_bytes := block_step_bytes(model)) is not None:
        read, full = step_bytes[0] / 1e6, step_bytes[1] / 1e6
        # benchmarks read "read the checkpoint's own blocks: X MB a step" from this line
        line += (f"; steps of up to {plan.quant_max_rows} rows read the checkpoint's own blocks: {read:.1f} MB a step, "
                 f"not {full:.1f} MB of bfloat16")
    logger.info(line)
