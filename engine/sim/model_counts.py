"""Parameter counts of a `ModelArch` by role, and loading an arch by name for the planner.

Counts assume the Llama family the engine implements: no biases, gated MLP (gate, up,
down), per-expert MLPs plus a router for MoE. Totals come from `ModelArch.num_parameters`
(norms included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

import conf
from engine.model.arch import ModelArch

MODEL_CONF_DIR = Path(conf.__file__).parent / "model"


def load_arch(name_or_path: str) -> ModelArch:
    """From `conf/model/<name>.yaml` (its `arch:` section), another yaml, or a HF config.json."""
    path = Path(name_or_path)
    if not path.is_file():
        path = MODEL_CONF_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no model config {name_or_path!r} (looked in {MODEL_CONF_DIR})")
    data = yaml.safe_load(path.read_text())  # JSON is valid YAML
    return ModelArch.from_hf_config(data.get("arch", data), name=path.stem)


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
