"""Parameter counts of a `ModelArch` by role, and loading an arch by name for the planner.

Counts assume the Llama family the engine implements: no biases, gated MLP (gate, up,
down), per-expert MLPs plus a router for MoE. Totals come from `ModelArch.num_parameters`
(norms included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.model.arch import ModelArch
from engine.model.loader import read_shape
from engine.model.source import find_shape, known_shapes


def load_arch(name_or_path: str, shape_dirs: Sequence[str | Path] = ()) -> ModelArch:
    """A model shape by path (yaml, or a HF config.json), or by name in `shape_dirs` then in
    the packaged `engine/model/shapes/`."""
    path = Path(name_or_path)
    found = path if path.is_file() else find_shape(name_or_path, shape_dirs)
    if found is None:
        known = ", ".join(known_shapes(shape_dirs))
        raise FileNotFoundError(f"no model config {name_or_path!r} (known shapes: {known})")
    return read_shape(found)


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Linear-layer weights of one layer by role, whole model (no tensor parallelism)."""

    attn: int  # q, k, v, o projections
    mlp: int  # one dense MLP, or one expert
    router: int  # 0 for dense models
    total: int  # every stored weight of the model

    @classmethod
    def of(cls, arch: ModelArch) -> ParamCounts:
        h = arch.hidden_size
        attn = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
        router = h * arch.num_experts if arch.is_moe else 0
        return cls(attn, 3 * h * arch.intermediate_size, router, arch.num_parameters())

    def layer(self, num_experts: int) -> int:
        """All linear weights of one layer (every expert counted)."""
        return self.attn + max(1, num_experts) * self.mlp + self.router
