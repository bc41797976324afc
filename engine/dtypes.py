"""The dtype names the engine knows, and the one map between them.

Configuration names are torch's (`float32`, `bfloat16`, `float16`; the KV cache may also be
`fp8_e4m3` / `fp8_e5m2` on the simulator); the cost models use the short names of datasheets
(`fp32`, `bf16`, `fp16`, `fp8`). `torch_dtype` and `canonical_dtype` convert; nothing else keeps a
copy of either table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch name -> short name, for the dtypes the model runs in.
MODEL_DTYPES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Bytes per element of every short name the cost models know.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_SHORT_ALIASES: dict[str, str] = {**MODEL_DTYPES, "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def torch_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` (or `"bf16"`) -> `torch.bfloat16`; ValueError naming the known dtypes."""
    import torch

    long = {short: long for long, short in MODEL_DTYPES.items()}.get(name, name)
    if long not in MODEL_DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(MODEL_DTYPES)}, got {name!r}")
    dtype: torch.dtype = getattr(torch, long)
    return dtype


def canonical_dtype(name: str) -> str:
    """`"bfloat16"` -> `"bf16"` (short names pass through); ValueError on an unknown dtype."""
    short = _SHORT_ALIASES.get(name, name)
    if short not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)} and {sorted(_SHORT_ALIASES)}")
    return short
