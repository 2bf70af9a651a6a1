"""Generated documentation is up to date."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from ravnest_node.bench.config import BenchConfig
from ravnest_node.cli.reference import render
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.launch.demo import DemoConfig
from ravnest_node.settings import field_docs, is_setting

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "docs/configuration.md is stale: run `make docs`"


def _fields(cls: type, prefix: str = "") -> Iterator[tuple[str, str, bool]]:
    """(dotted setting, its docstring, whether it is a leaf) of a config class tree; a flat
    section's settings are addressed as its parent's (settings.py)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not is_setting(f):  # (settings.py skips it: TransportConfig.node_key)
            continue
        section = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        yield f"{prefix}{f.name}", docs.get(f.name, ""), section is None
        if section is not None:
            flat = f.metadata.get("flat", False)
            yield from _fields(section, prefix if flat else f"{prefix}{f.name}.")


@pytest.mark.parametrize("cls", [NodeConfig, DemoConfig, BenchConfig])
def test_every_setting_has_a_docstring_and_is_in_the_reference(cls: type) -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    for name, doc, leaf in _fields(cls):
        assert doc, f"{cls.__name__}.{name} has no docstring"
        assert not leaf or f"| `{name}` |" in reference, f"{name} is not in the reference"
