"""Generated documentation is up to date."""

from __future__ import annotations

from pathlib import Path

from ravnest_node.cli.reference import render

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "docs/configuration.md is stale: run `make docs`"
