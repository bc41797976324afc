"""Attention backends by name. Imports are lazy so GPU-only backends cost nothing on a CPU."""

from __future__ import annotations

import importlib

import torch

from engine.attention.backend import AttentionBackend

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("engine.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("engine.attention.triton_backend", "TritonAttentionBackend"),
    "flash_attn": ("engine.attention.flash_backend", "FlashAttnBackend"),
    "flashinfer": ("engine.attention.flash_backend", "FlashInferBackend"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Instantiate backend `name` for `device`; ValueError with the reason if it cannot run there."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend: unknown {name!r}; choose one of {available_backends()}")
    module_name, cls_name = _BACKENDS[name]
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except ImportError as exc:
        raise ValueError(f"attention backend {name!r} is unavailable: {exc}") from exc
    ok, reason = cls.is_available(device)
    if not ok:
        raise ValueError(f"attention backend {name!r} is unavailable on {device}: {reason}")
    return cls()
