"""RoPE frequency scaling for contexts longer than a model's pre-training (Llama-3.1's "llama3").

Llama-3.1 was pre-trained at 8,192 positions and extended to 131,072 by rescaling the rotary
frequencies once, before the cos/sin table is built (nothing changes per step):
- a frequency whose wavelength is shorter than `original_max_position_embeddings /
  high_freq_factor` (it turns many times inside the old context) is kept;
- one whose wavelength is longer than `original_max_position_embeddings / low_freq_factor`
  (it never completed a turn in the old context) is divided by `factor`;
- in between, the two are blended linearly in `original_max_position_embeddings / wavelength`.

A checkpoint states it as Hugging Face's `rope_scaling` (or, in newer configs, `rope_parameters`)
mapping: `{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4,
original_max_position_embeddings: 8192}`.

Gemma 3's global layers use "linear" scaling instead (`{rope_type: linear, factor: 8}`, the 4B-27B
models): every frequency divided by `factor`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# rope_type values that mean "no scaling".
_UNSCALED = (None, "default")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's frequency scaling, or linear scaling (`rope_type` "linear": `factor` alone)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | None) -> RopeScaling | None:
        """From a HF config's `rope_scaling` / `rope_parameters` mapping; None when it asks for no
        scaling. Raises ValueError for a scaling type the engine does not implement (running the
        model unscaled would give wrong outputs without a word) or a missing llama3 field."""
        if not cfg:
            return None
        kind = cfg.get("rope_type", cfg.get("type"))
        if kind in _UNSCALED:
            return None
        if kind == "linear":
            if not float(cfg.get("factor") or 0) > 0:
                raise ValueError(f"model: linear rope scaling needs factor > 0, got {cfg!r}")
            return cls(float(cfg["factor"]), 0.0, 0.0, 0, rope_type="linear")
        if kind != "llama3":
            raise ValueError(f"model: rope scaling {kind!r} is not supported (supported: llama3, linear)")
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if cfg.get(k) is None]
        if missing:
            raise ValueError(f"model: llama3 rope scaling lacks {', '.join(missing)}")
        scaling = cls(float(cfg["factor"]), float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"]),
                      int(cfg["original_max_position_embeddings"]))  # fmt: skip
        if not scaling.high_freq_factor > scaling.low_freq_factor > 0 or scaling.factor <= 0:
            raise ValueError(f"model: llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, "
                             f"got {cfg!r}")  # fmt: skip
        return scaling

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """inv_freq: [D/2] rotary frequencies (radians per position) -> the scaled ones, same dtype."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        old_len = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq  # positions per turn
        keep_below = old_len / self.high_freq_factor  # shorter wavelengths: unchanged
        divide_above = old_len / self.low_freq_factor  # longer wavelengths: divided by factor
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = blended.where(wavelen >= keep_below, inv_freq)
        return (inv_freq / self.factor).where(wavelen > divide_above, out)
