"""The target registry (workloads/targets/registry.py; issue 56 item 4): every kind servelab-run can
be given is declared there once, and nothing else in the workbench switches on its name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from conf.schema import TargetSection
from workloads.targets.registry import TARGETS, target_kind

ROOT = Path(__file__).resolve().parent.parent


def test_every_target_config_is_a_registered_kind_and_every_kind_has_one() -> None:
    kinds = {path.stem: yaml.safe_load(path.read_text())["kind"] for path in (ROOT / "conf" / "target").glob("*.yaml")}
    assert all(stem == kind for stem, kind in kinds.items()), kinds  # target=X selects kind X
    assert set(kinds) == set(TARGETS)


def test_an_unknown_kind_is_one_error_naming_every_kind() -> None:
    with pytest.raises(ValueError) as err:
        target_kind("servr")
    message = str(err.value)
    assert message.startswith("target.kind: unknown 'servr'")
    assert all(name in message for name in TARGETS)


def test_each_kind_is_made_or_runs_itself_and_reads_real_fields() -> None:
    fields = {f.name for f in dataclasses.fields(TargetSection)}
    for kind in TARGETS.values():
        assert (kind.make is None) != (kind.run is None), kind.name
        assert set(kind.config) <= fields, (kind.name, set(kind.config) - fields)
        # the driver scrapes exactly the kinds that read the scrape interval
        assert kind.scraped == ("metrics_interval_s" in kind.config), kind.name
        assert kind.run is None or not kind.scraped, kind.name  # no driver, no scrape


def test_the_declared_flags_are_the_old_switches() -> None:
    """The string switches the registry replaced, as they were (behaviour unchanged)."""
    assert {k for k, v in TARGETS.items() if v.scraped} == {"server", "openai", "pd", "vllm", "llamacpp"}
    assert {k for k, v in TARGETS.items() if v.engine} == {"offline", "inprocess", "server", "pd"}
    assert {k for k, v in TARGETS.items() if not v.model_dtype} == {"simulated"}
    assert {k for k, v in TARGETS.items() if v.run is not None} == {"offline", "simulated"}


def test_no_switch_on_the_kind_outside_the_registry() -> None:
    switch = re.compile(r"target\.kind\s*(==|!=|in\s*[(\[{])|ENGINE_TARGETS")
    found = [f"{path.relative_to(ROOT)}:{i}" for folder in ("workloads", "reports", "analysis")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if switch.search(line)]  # fmt: skip
    assert not found, found
