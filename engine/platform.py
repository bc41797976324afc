"""The device, and the model dtype that `dtype="auto"` resolves to.

`dtype="auto"` (vLLM's name and meaning) is resolved once, here, and logged once:
- on a GPU: the checkpoint's dtype (an HF folder's `config.json` `torch_dtype`; a GGUF or a
  dummy / conf-only model: bfloat16, as vLLM loads a quantised GGUF);
- on a CPU: the faster of bfloat16 and float32 on this CPU, as engine/kernels/isa.py decides it
  from the CPU's flags (and a short GEMM probe where they do not decide).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.kernels.isa import fastest_cpu_dtype, warn_emulated_bfloat16
from engine.model.source import resolve_source

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(source_kind: str, path: Path) -> str:
    """The dtype a checkpoint was saved in (an HF folder's `torch_dtype` / `dtype`); bfloat16 otherwise."""
    if source_kind == "hf":
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return name if name in DTYPE_NAMES else "bfloat16"
    return "bfloat16"  # GGUF (quantised: vLLM dequantises to bfloat16), dummy and conf-only models


_logged: set[tuple[str, str]] = set()


def resolve_dtype(dtype: str, device: torch.device, source_kind: str = "gguf", path: Path | None = None) -> str:
    """The concrete dtype name for `dtype` on `device` ("auto" resolved; others returned as is).

    ValueError for a name that is neither "auto" nor one of DTYPE_NAMES. The resolution of
    "auto" is logged once per process ("dtype auto -> bfloat16 (avx512_bf16)").
    """
    if dtype in DTYPE_NAMES:
        if dtype == "bfloat16" and device.type == "cpu":
            warn_emulated_bfloat16()
        return dtype
    if dtype != "auto":
        raise ValueError(f"dtype: must be auto or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if device.type == "cpu":
        name, why = fastest_cpu_dtype()
    else:
        name, why = checkpoint_dtype(source_kind, path or Path()), f"checkpoint dtype on {device.type}"
    if (name, why) not in _logged:
        _logged.add((name, why))
        logger.info("dtype auto -> %s (%s)", name, why)
    return name


def resolve_device(name: str, check: bool = True) -> torch.device:
    """The torch device for a config's `device.device`: "auto" is CUDA where available, else the CPU.

    ValueError for "cuda..." on a machine without a CUDA GPU, unless `check` is False (callers
    that only ask which kind of device a config names).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if check and name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA GPU is available")
    return torch.device(name)


def resolve_engine_dtype(dtype: str, device: str, model: str) -> str:
    """`resolve_dtype` for a config's `model.dtype`, `device.device` ("auto" | "cpu" | "cuda..."), `model`."""
    if dtype in DTYPE_NAMES:
        return dtype
    dev = resolve_device(device, check=False)
    kind, path = "gguf", None
    if dev.type != "cpu":
        try:
            source = resolve_source(model)
            kind, path = source.kind, source.path
        except ValueError:  # reported by the loader, with its own message
            pass
    return resolve_dtype(dtype, dev, kind, path)
