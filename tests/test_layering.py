"""The layering of docs/architecture.md holds: import-linter's contracts (pyproject.toml) are
kept, the package root loads lazily (importing a codec imports neither gRPC nor the daemon),
and the version has one source."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import ravnest_node

ROOT = Path(__file__).resolve().parent.parent


def test_the_layering_contracts_are_kept() -> None:
    """`make check` runs the same (lint-imports): a lower layer never imports a higher one, and
    no two packages or modules of one package import each other. (In a process of its own:
    import-linter configures logging, which would silence the loggers other tests capture.)"""
    lint = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))"
    )
    result = subprocess.run([sys.executable, "-c", lint], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]


def _loaded_by(statement: str) -> list[str]:
    code = (
        f"import json, sys\n{statement}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'zeroconf', 'ravnest_node'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_a_codec_imports_only_what_it_needs() -> None:
    loaded = _loaded_by("import ravnest_node.compression.quant")
    assert "ravnest_node.compression.quant" in loaded
    assert not [m for m in loaded if m.startswith(("grpc", "zeroconf", "ravnest_node.daemon",
                                                   "ravnest_node.transport"))], loaded  # fmt: skip


def test_the_package_root_loads_its_names_on_first_use() -> None:
    assert "ravnest_node.daemon.node" not in _loaded_by("import ravnest_node")
    loaded = _loaded_by("from ravnest_node import NodeDaemon")
    assert "ravnest_node.daemon.node" in loaded
    assert set(ravnest_node.__all__) <= set(dir(ravnest_node))
    for name in ravnest_node.__all__:
        assert getattr(ravnest_node, name) is not None


def test_the_version_is_the_distributions() -> None:
    assert ravnest_node.__version__ == metadata.version("ravnest-node")
    out = subprocess.run([sys.executable, "-m", "ravnest_node", "--version"], check=True,
                         capture_output=True, text=True)  # fmt: skip
    assert out.stdout.split() == ["ravnest-node", ravnest_node.__version__]
