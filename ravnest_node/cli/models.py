"""`ravnest-node models`: the models this installation can train, built in and installed.

Each model is built on the meta device (models/base.py `shapes_only`) to count its blocks and
parameters: nothing is allocated and no weight is read. A model whose package's entry point is
broken is listed with its error; the command itself does not fail for it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

from ravnest_node.models import MODEL_PRESETS, get_model, installed_models
from ravnest_node.models.base import shapes_only
from ravnest_node.models.installed import ENTRY_POINT_GROUP
from ravnest_node.models.registry import hidden_models

__all__ = ["ModelRow", "add_models_parser", "model_rows", "run_models"]

BUILTIN = "built-in"


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One line of `ravnest-node models`."""

    name: str
    source: str
    """``built-in``, or the distribution and its entry point (installed.Installed.origin)."""
    blocks: int | None = None
    parameters: int | None = None
    error: str = ""
    """Why the model cannot be built here (then no blocks nor parameters)."""


def _row(name: str, source: str) -> ModelRow:
    try:
        model = get_model(name)
        with shapes_only():
            built = model.build_blocks(0)
        parameters = sum(p.numel() for block in built for p in block.parameters())
        return ModelRow(name, source, len(built), parameters)
    except Exception as exc:  # a package's model: whatever it raises is listed, not fatal
        return ModelRow(name, source, error=f"{type(exc).__name__}: {exc}")


def model_rows() -> list[ModelRow]:
    """The built-in models, then the installed ones, each sorted by name; last, those of
    packages that a built-in name hides (with that as their error)."""
    rows = [_row(name, BUILTIN) for name in sorted(MODEL_PRESETS)]
    rows += [_row(name, info.origin) for name, info in sorted(installed_models().items())]
    hidden = hidden_models()
    rows += [ModelRow(name, info.origin, error="ignored: a built-in model has that name")
             for name, info in sorted(hidden.items())]  # fmt: skip
    return rows


def add_models_parser(commands: Any) -> None:
    """Register the `models` subcommand on `commands` (argparse sub-parsers)."""
    models = commands.add_parser(
        "models",
        help="list the models this installation can train, built in and installed",
        description="List the built-in models and those that installed packages declare "
        f"(entry-point group {ENTRY_POINT_GROUP}): name, blocks, parameters, and where each "
        "comes from. Every node of a swarm needs the swarm's model installed; a swarm can "
        "also train a Hugging Face directory, hf:DIR (docs).",
    )
    models.add_argument("--json", action="store_true", help="one JSON object a model")


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def run_models(args: argparse.Namespace) -> int:
    """Print the table (or JSON lines); exit status 0, even if a model is broken."""
    rows = model_rows()
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    head = ("MODEL", "BLOCKS", "PARAMETERS", "SOURCE")
    lines = [
        (
            r.name,
            _count(r.blocks),
            _count(r.parameters),
            r.source + (f": {r.error}" if r.error else ""),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [head, *lines]) for i in range(3)]
    for line in [head, *lines]:
        print(f"{line[0]:<{widths[0]}}  {line[1]:>{widths[1]}}  {line[2]:>{widths[2]}}  {line[3]}")
    return 0
