"""Loading a Hugging Face model folder: config.json + *.safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.model.arch import ModelArch


def read_hf_arch(folder: str | Path) -> ModelArch:
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model: cannot read {str(folder / 'config.json')!r}: {e}") from e
    return ModelArch.from_hf_config(cfg, name=folder.name)


def load_hf_state_dict(
    folder: str | Path, arch: ModelArch | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, cast to `dtype`, HF names kept.

    Layers at or beyond `arch.num_layers` are skipped. ValueError when the folder has
    no safetensors file.
    """
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {str(folder)!r} has no *.safetensors files")
    max_layers = arch.num_layers if arch is not None else None
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if max_layers is not None and _layer_index(name) >= max_layers:
                    continue
                state[name] = f.get_tensor(name).to(dtype)
    return state


def _layer_index(name: str) -> int:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return -1
