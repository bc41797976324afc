"""Write the field tables of docs/configuration.md from the config dataclasses.

The dataclasses (`engine/config.py`, `conf/schema.py`) are the one source of every field's
name, type, default and description; the description is the attribute docstring under the
field, read from the source with `ast` (dataclasses keep no docstrings at run time). The
document marks each generated table:

    <!-- BEGIN GENERATED: engine.config.SchedulerConfig prefix=scheduler. -->
    ...
    <!-- END GENERATED -->

The spec after `GENERATED:` is a dotted class path, then options: `prefix=P` (put before each
field name), `own` (only the fields the class itself declares, not inherited ones),
`fields=a,b` (only these, in this order) and `style=kwargs` (for `EngineConfig`: one row per
flat keyword of `EngineConfig.from_kwargs`). Everything outside the markers is hand-written
and kept byte for byte.

    python scripts/gen_config_docs.py           # rewrite docs/configuration.md
    python scripts/gen_config_docs.py --check   # exit 1 with a unified diff if it is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import importlib
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
# The modules whose dataclasses the reference documents; each of their fields needs a description.
MODULES = ("engine.config", "engine.config_features", "conf.schema")

MARKER = re.compile(r"<!-- BEGIN GENERATED: (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- END GENERATED -->", re.S)

if str(ROOT) not in sys.path:  # run as `python scripts/gen_config_docs.py`
    sys.path.insert(0, str(ROOT))


@functools.cache
def _class_nodes(module_name: str) -> dict[str, ast.ClassDef]:
    """The top-level class definitions of a module, parsed from its source file."""
    module = importlib.import_module(module_name)
    source = Path(module.__file__ or "").read_text(encoding="utf-8")
    return {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}


def declared_fields(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (annotation as written, attribute docstring with whitespace collapsed) for
    the fields `cls` itself declares; a field without a docstring has ""."""
    node = _class_nodes(cls.__module__).get(cls.__name__)
    if node is None:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for i, stmt in enumerate(node.body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        nxt = node.body[i + 1] if i + 1 < len(node.body) else None
        text = ""
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            text = " ".join(nxt.value.value.split())
        out[stmt.target.id] = (ast.unparse(stmt.annotation), text)
    return out


def _merged(cls: type) -> dict[str, tuple[str, str]]:
    merged: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):  # the most derived declaration wins
        if dataclasses.is_dataclass(klass):
            merged.update(declared_fields(klass))
    return merged


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> description for every field of dataclass `cls`, inherited ones included
    (the most derived class that declares a field gives its description)."""
    merged = _merged(cls)
    return {f.name: merged.get(f.name, ("", ""))[1] for f in dataclasses.fields(cls)}


def field_types(cls: type) -> dict[str, str]:
    """Field name -> its annotation as the source writes it (`int | None`, `list[str]`)."""
    merged = _merged(cls)
    return {f.name: merged.get(f.name, (str(f.type), ""))[0] for f in dataclasses.fields(cls)}


def documented_classes() -> list[type]:
    """Every dataclass defined in `MODULES`, in source order."""
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for cls_name in _class_nodes(name):
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == name:
                out.append(cls)
    return out


def type_text(annotation: str) -> str:
    """An annotation as the tables write it: `int or null`, `list[str]`, `LengthSection`."""
    parts = ["null" if p.strip() == "None" else p.strip() for p in annotation.split(" | ")]
    return " or ".join(parts)


def value_text(value: Any) -> str:
    """A default value as YAML writes it (null, true, [a, b], {}), without quotes around strings."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        base = type(value)()
        changed = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                   if getattr(value, f.name) != getattr(base, f.name)]  # fmt: skip
        return f"{type(value).__name__}({', '.join(changed)})"
    return repr(value)


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"`{value_text(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def field_table(cls: type, prefix: str = "", only: list[str] | None = None, own: bool = False) -> str:
    """The markdown table (field, type, default, meaning) of dataclass `cls`."""
    docs, types = field_docs(cls), field_types(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if only is not None:
        names = only
    elif own:
        names = [n for n in declared_fields(cls) if n in by_name]
    else:
        names = list(by_name)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name in names:
        f = by_name[name]
        rows.append(
            f"| `{prefix}{name}` | {_cell(type_text(types[name]))} | {default_text(f)} | {_cell(docs[name].removesuffix('.'))} |"
        )
    return "\n".join(rows) + "\n"


def kwargs_table(cls: type) -> str:
    """One row per flat keyword of `EngineConfig.from_kwargs`: every field of every section,
    with the aliases of `engine.config.KWARG_ALIASES`."""
    from engine.config import KWARG_ALIASES

    aliases: dict[tuple[str, str], list[str]] = {}
    for alias, target in sorted(KWARG_ALIASES.items()):
        aliases.setdefault(target, []).append(alias)
    rows = ["| keyword | section | type | default |", "|---|---|---|---|"]
    for section in dataclasses.fields(cls):
        section_cls = (
            type(section.default_factory()) if section.default_factory is not dataclasses.MISSING else None
        )
        if section_cls is None or not dataclasses.is_dataclass(section_cls):
            continue
        types = field_types(section_cls)
        for f in dataclasses.fields(section_cls):
            names = ", ".join(f"`{a}`" for a in aliases.get((section.name, f.name), []))
            keyword = f"`{f.name}`" + (f" (alias {names})" if names else "")
            rows.append(
                f"| {keyword} | `{section_cls.__name__}` | {_cell(type_text(types[f.name]))} | {default_text(f)} |"
            )
    return "\n".join(rows) + "\n"


def render_spec(spec: str) -> str:
    """The generated text for one marker's spec (see the module docstring)."""
    path, *options = spec.split()
    module_name, _, cls_name = path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    opts = {key: value for key, _, value in (o.partition("=") for o in options)}
    unknown = set(opts) - {"prefix", "fields", "own", "style"}
    if unknown:
        raise ValueError(f"generated section {spec!r}: unknown option(s) {', '.join(sorted(unknown))}")
    if opts.get("style") == "kwargs":
        return kwargs_table(cls)
    only = opts["fields"].split(",") if "fields" in opts else None
    return field_table(cls, prefix=opts.get("prefix", ""), only=only, own="own" in opts)


def render(text: str) -> str:
    """`text` with the body of every generated section rewritten; the rest unchanged."""

    def replace(match: re.Match[str]) -> str:
        spec = match.group("spec")
        return f"<!-- BEGIN GENERATED: {spec} -->\n{render_spec(spec)}<!-- END GENERATED -->"

    return MARKER.sub(replace, text)


def check(path: Path = DOC) -> str:
    """A unified diff from the file to what `render` would write ("" when up to date)."""
    current = path.read_text(encoding="utf-8")
    wanted = render(current)
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    diff = difflib.unified_diff(current.splitlines(keepends=True), wanted.splitlines(keepends=True),
                                fromfile=f"{rel} (checked in)", tofile=f"{rel} (generated)")  # fmt: skip
    return "".join(diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if the file is stale")
    parser.add_argument(
        "--path", type=Path, default=DOC, help="the document (default: docs/configuration.md)"
    )
    args = parser.parse_args(argv)
    path = args.path.resolve()
    if args.check:
        diff = check(path)
        if diff:
            sys.stdout.write(diff)
            print(
                f"{path}: out of date; run `make docs` (python scripts/gen_config_docs.py)", file=sys.stderr
            )
            return 1
        return 0
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if new != text:
        path.write_text(new, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
