"""Random weights for any architecture (vLLM's "dummy" load format).

For benchmarking shapes without downloading weights: every matrix ~ N(0, std), every
norm weight the one that scales by 1 (so activations stay in range through many layers): 1 for
RMSNorm's w, 0 for a norm that multiplies by (1 + w) like Gemma's (its `identity_weight`). Seeded, so two
engines with the same seed hold the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Fill every parameter of `model` in place (device and dtype kept)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dim() == 1 and name.endswith("norm.weight"):
            owner = model.get_submodule(name.rpartition(".")[0])
            param.fill_(float(getattr(owner, "identity_weight", 1.0)))
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=gen)
