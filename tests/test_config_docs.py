"""docs/configuration.md's field tables are generated from the config dataclasses
(scripts/gen_config_docs.py): the checked-in file must be what the generator writes, and every
field must carry a description for it to write."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
sys.modules["gen_config_docs"] = gen
_spec.loader.exec_module(gen)


def test_checked_in_reference_is_what_the_generator_writes():
    diff = gen.check(gen.DOC)
    assert diff == "", f"docs/configuration.md is stale; run `make docs`:\n{diff}"


def test_every_config_field_has_a_description():
    classes = gen.documented_classes()
    names = {c.__name__ for c in classes}
    assert {"SchedulerConfig", "ModelConfig", "EngineConfig", "RunConfig", "WorkloadSection"} <= names
    missing = [f"{c.__module__}.{c.__name__}.{name}" for c in classes
               for name, doc in gen.field_docs(c).items() if not doc]  # fmt: skip
    assert missing == [], f"fields without a docstring under them: {missing}"


def test_every_documented_class_has_a_table():
    text = gen.DOC.read_text(encoding="utf-8")
    specs = [m.group("spec").split()[0] for m in gen.MARKER.finditer(text)]
    covered = {spec.rpartition(".")[2] for spec in specs}
    # ModelConfig's fields are ModelSection's table; the front doors' roots compose sections.
    composed = {"ModelConfig", "EngineSections", "ServeConfig", "PlanConfig"}
    untabled = [c.__name__ for c in gen.documented_classes() if c.__name__ not in covered | composed]
    assert untabled == []


def test_a_field_without_docstring_is_found(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cfgdoc_probe_a", raising=False)
    (tmp_path / "cfgdoc_probe_a.py").write_text(
        textwrap.dedent('''
        from dataclasses import dataclass, field

        @dataclass
        class Base:
            depth: int = 2
            """How deep."""

        @dataclass
        class Probe(Base):
            size: int | None = None
            """How big
            (null: any)."""
            tags: list[str] = field(default_factory=lambda: ["a"])
            undocumented: bool = True
    ''')
    )
    module = importlib.import_module("cfgdoc_probe_a")
    assert gen.field_docs(module.Probe) == {"depth": "How deep.", "size": "How big (null: any).", "tags": "",
                                            "undocumented": ""}  # fmt: skip
    table = gen.field_table(module.Probe, prefix="probe.")
    assert "| `probe.size` | int or null | `null` | How big (null: any) |" in table
    assert "| `probe.tags` | list[str] | `[a]` |  |" in table
    assert "| `probe.depth` | int | `2` | How deep |" in table


def test_render_keeps_prose_byte_for_byte_and_check_reports_a_diff(tmp_path, capsys):
    prose_a = "# Title\n\nSome prose | with a pipe,\ttabs and trailing spaces   \n\n"
    prose_b = "\nMore prose.\n<!-- a comment -->\n"
    stale = (prose_a + "<!-- BEGIN GENERATED: engine.config.AttentionConfig prefix=attention. -->\n"
             "| old | table |\n<!-- END GENERATED -->\n" + prose_b)  # fmt: skip
    doc = tmp_path / "configuration.md"
    doc.write_text(stale)

    assert gen.main(["--check", "--path", str(doc)]) == 1
    out = capsys.readouterr().out
    assert "-| old | table |" in out and "+| `attention.backend` | str | `torch` |" in out
    assert doc.read_text() == stale  # --check writes nothing

    assert gen.main(["--path", str(doc)]) == 0
    fresh = doc.read_text()
    assert fresh.startswith(prose_a) and fresh.endswith("<!-- END GENERATED -->\n" + prose_b)
    from engine.config import AttentionConfig

    assert gen.field_table(AttentionConfig, prefix="attention.") in fresh
    assert gen.render(fresh) == fresh  # a second run changes nothing
    assert gen.main(["--check", "--path", str(doc)]) == 0


def test_unknown_marker_option_is_an_error():
    with pytest.raises(ValueError, match="unknown option"):
        gen.render_spec("engine.config.CacheConfig prefx=cache.")


def test_kwargs_table_lists_every_engine_keyword():
    from engine.config import EngineConfig

    table = gen.kwargs_table(EngineConfig)
    sections = [f.default_factory() for f in dataclasses.fields(EngineConfig)]  # type: ignore[misc]
    for section in sections:
        for f in dataclasses.fields(section):
            assert f"| `{f.name}`" in table
    assert (
        "| `num_blocks` (alias `num_gpu_blocks_override`) | `CacheConfig` | int or null | `null` |" in table
    )
