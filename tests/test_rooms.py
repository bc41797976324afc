"""The engine's rooms and the rules between them (issue 56; docs/architecture.md draws them).

- engine/kernels/ imports no model, front end, core, worker, server or sampler: what it reads of a
  model is declared there as protocols (engine/kernels/forward_plan.py); only the attention
  backend's types, for annotations.
- Outside engine/kernels/, code imports only the kernels' API modules (`engine.kernels.API`), never
  their internals (`engine.kernels.INTERNAL`: the builder, the one-call decoder op).
- Which instruction set runs is decided in engine/kernels/: outside it, only the modules named in
  ISA_READERS read the CPU's flags (engine/kernels/isa.py), each for the reason given.
- The engine never imports the workbench (workloads, reports, conf, profiling, history, analysis).

Unlike tests/test_import_graph.py, imports under `if TYPE_CHECKING:` count here: an annotation
that names a model's class is still the kernels knowing the model.
"""

from __future__ import annotations

import ast
from pathlib import Path

import engine.kernels
from engine.config import KERNEL_ENV_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent
WORKBENCH = ("workloads", "reports", "conf", "profiling", "history", "analysis")
# engine packages the kernels must not import (the attention backend's types are allowed)
ABOVE_KERNELS = ("engine.model", "engine.frontend", "engine.core", "engine.worker", "engine.entrypoints",
                 "engine.sample", "engine.executor", "engine.spec_decode", "engine.sim")  # fmt: skip
ISA_READERS = {
    "engine.platform": "dtype=auto resolves to what the CPU multiplies fastest (isa.fastest_cpu_dtype)",
    "engine.sim.hardware": "the simulator's hardware profile records the CPU it was measured on",
    "engine.entrypoints.serve": "a server's dtype=auto (isa.serving_cpu_dtype)",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the file, TYPE_CHECKING blocks and functions included;
    `from a import b` gives `a.b` (a submodule or a name in `a`: both start with `a`)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def engine_files() -> list[Path]:
    return sorted((ROOT / "engine").rglob("*.py"))


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_import_reader_sees_every_form() -> None:
    names = {n for n, _ in imported(ROOT / "engine" / "kernels" / "forward_plan.py")}
    assert "engine.attention.backend.AttentionMetadata" in names  # under TYPE_CHECKING: counted
    assert "engine.kernels.cpu_blocks" in names  # `from engine.kernels import cpu_blocks`
    worker = {n for n, _ in imported(ROOT / "engine" / "worker" / "worker.py")}
    assert "engine.kernels.options" in worker


def test_the_kernels_import_no_model_and_nothing_above_them() -> None:
    bad = []
    for path in sorted((ROOT / "engine" / "kernels").rglob("*.py")):
        for name, line in imported(path):
            if any(under(name, p) for p in ABOVE_KERNELS):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
            elif under(name, "engine.attention") and not under(name, "engine.attention.backend"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} (only the backend's types)")
    assert not bad, "the kernels reach above their room:\n" + "\n".join(bad)


def test_outside_the_kernels_only_their_api_is_imported() -> None:
    api, internal = set(engine.kernels.API), set(engine.kernels.INTERNAL)
    kernel_modules = {p.stem for p in (ROOT / "engine" / "kernels").glob("*.py")} - {"__init__"}
    assert kernel_modules == api | internal, f"engine/kernels/__init__.py: list every module ({kernel_modules ^ (api | internal)})"
    bad = []
    for package in ("engine", *WORKBENCH):
        for path in sorted((ROOT / package).rglob("*.py")):
            if under(module_name(path), "engine.kernels"):
                continue
            for name, line in imported(path):
                if under(name, "engine.kernels") and name.split(".")[2:3] and name.split(".")[2] in internal:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "kernel internals imported outside engine/kernels/:\n" + "\n".join(bad)


def test_only_the_named_modules_read_the_cpu_flags_outside_the_kernels() -> None:
    readers = set()
    for path in engine_files():
        module = module_name(path)
        if under(module, "engine.kernels"):
            continue
        if any(under(name, "engine.kernels.isa") for name, _ in imported(path)):
            readers.add(module)
    assert readers == set(ISA_READERS), (
        f"new readers of the CPU's flags outside engine/kernels/: {sorted(readers - set(ISA_READERS))} "
        f"(decide in engine/kernels/ and ask it), stale entries: {sorted(set(ISA_READERS) - readers)}")


def test_the_engine_never_imports_the_workbench() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in engine_files()
           for name, line in imported(path) if name.split(".")[0] in WORKBENCH]  # fmt: skip
    assert not bad, "the engine imports the workbench:\n" + "\n".join(bad)


# Every environment variable the engine reads, and why it is not a behaviour switch of ours: the
# kernels section's overrides (each read into its field: engine/config.py) and these.
ENVIRONMENT = {
    **{var: f"overrides kernels.{field}, read into the field" for field, var in KERNEL_ENV_OVERRIDES.items()},
    "SERVELAB_CPU_MARCH": "a build override: the -march the C++ kernels are built for (cpu_extension.MARCH_ENV)",
    "TRITON_INTERPRET": "Triton's own switch: its kernels on a CPU",
    "RANK": "torch.distributed's env:// rendezvous",
    "LOCAL_RANK": "torch.distributed's env:// rendezvous",
    "WORLD_SIZE": "torch.distributed's env:// rendezvous",
    "MASTER_ADDR": "torch.distributed's env:// rendezvous",
    "MASTER_PORT": "torch.distributed's env:// rendezvous",
    "GLOO_SOCKET_IFNAME": "gloo's interface choice (engine/distributed/parallel_state.py pins it)",
    "OMP_NUM_THREADS": "OpenMP's thread count: servelab-serve leaves it alone where the user set it",
}


def test_the_engine_reads_only_the_named_environment_variables() -> None:
    """`os.environ` / `getenv` in engine/ (Python and C++) name only ENVIRONMENT's variables."""
    import re

    found: dict[str, str] = {}
    pattern = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["']([A-Z_0-9]+)["']|"([A-Z_0-9]+)" not in os\.environ""")
    for path in sorted((ROOT / "engine").rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h"):
            continue
        for match in pattern.finditer(path.read_text()):
            found[match.group(1) or match.group(2)] = str(path.relative_to(ROOT))
    found |= {var: "engine/config.py" for var in KERNEL_ENV_OVERRIDES.values()}
    unknown = {var: where for var, where in found.items() if var not in ENVIRONMENT}
    assert not unknown, f"environment variables read in engine/ and not named here: {unknown}"
    assert {"TRITON_INTERPRET", "RANK", "SERVELAB_CPU_AMX"} <= set(found)  # the scan sees each form
