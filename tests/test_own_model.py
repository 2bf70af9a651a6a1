"""A model of one's own: a package that declares it under the entry-point group
``ravnest_node.models`` (models/installed.py) is trained by node processes that have it
installed, exactly as one process trains it; the example package is the one
docs/development.md shows (docs/examples/own_model/), installed with pip into a temporary
directory that only this test's processes see."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from ravnest_node.cli import models as models_command
from ravnest_node.cli.main import main
from ravnest_node.errors import ConfigError
from ravnest_node.models import (
    BlockModel,
    ByteLM,
    get_model,
    installed_models,
    model_names,
    registry,
)
from ravnest_node.models.installed import ENTRY_POINT_GROUP, InstalledModels, is_project_name

from .conftest import NODE_ENV, Procs, demo_summaries
from .training import assert_same_training, demo_run, plain_training

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "own_model"
"""The example package of docs/development.md ("Your own model")."""
SYNC = ("--seed", "0", "--max-staleness", "0", "--codec", "none", "--threads", "1")


def not_a_model() -> dict[str, int]:
    """A factory that returns something else than a BlockModel."""
    return {"blocks": 3}


def failing_factory() -> BlockModel:
    raise RuntimeError("no GPU here")


def misnamed() -> BlockModel:
    """A model whose name is not its entry point's."""
    return ByteLM(get_model("tiny").cfg, name="tiny")  # type: ignore[attr-defined]


def _points(**values: str) -> list[EntryPoint]:
    return [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in values.items()]


@pytest.fixture
def fake_installed(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[int]]:
    """Replace the installed packages' entry points by those given (name=value); returns a
    list that counts how often they were looked for. The example's module is importable."""
    monkeypatch.syspath_prepend(str(EXAMPLE))

    def install(**values: str) -> list[int]:
        looked: list[int] = []

        def find() -> list[EntryPoint]:
            looked.append(1)
            return _points(**values)

        monkeypatch.setattr(registry, "INSTALLED", InstalledModels(find))
        return looked

    return install


def test_an_installed_model_is_found_once_and_built_fresh(
    fake_installed: Callable[..., list[int]],
) -> None:
    looked = fake_installed(**{"tiny-mlp": "ravnest_tiny_mlp.model:make_model",
                               "never-asked": "no_such_module_at_all:make"})  # fmt: skip
    assert looked == []  # nothing is looked for while built-in names are asked for
    assert get_model("tiny").name == "tiny"
    assert looked == []
    model = get_model("tiny-mlp")
    assert isinstance(model, BlockModel) and model.name == "tiny-mlp" and model.num_blocks() == 6
    assert get_model("tiny-mlp") is not model
    assert {"tiny-mlp", "never-asked", "tiny"} <= set(model_names())
    # Found once; a module is imported only when its name is asked for (never-asked's is not).
    assert looked == [1]
    assert "no_such_module_at_all" not in sys.modules


def test_a_built_in_name_wins_over_a_package(
    fake_installed: Callable[..., list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    fake_installed(tiny="tests.test_own_model:not_a_model")
    with caplog.at_level(logging.WARNING):
        assert isinstance(get_model("tiny"), ByteLM)
        assert installed_models() == {}
    assert (
        "model 'tiny' of an unknown distribution (tests.test_own_model:not_a_model) is "
        "ignored: a built-in model has that name" in caplog.text
    )


def test_a_name_two_packages_declare_is_taken_once(caplog: pytest.LogCaptureFixture) -> None:
    found = InstalledModels(lambda: [*_points(mlp="b.module:make"), *_points(mlp="a.module:make")])
    with caplog.at_level(logging.WARNING):
        assert found.found(()) == found.found(())
        assert [info.value for info in found.found(()).values()] == ["a.module:make"]
    assert caplog.text.count("declares it too") == 1  # warned once, when first looked for


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no_such_module_at_all:make", r"cannot import entry point .*no_such_module_at_all:make"
                                       r".*ModuleNotFoundError"),
        ("tests.test_own_model:failing_factory", r"entry point .*failing_factory\) raised "
                                                 r"RuntimeError: no GPU here"),
        ("tests.test_own_model:not_a_model", r"returned a dict, not a ravnest_node.models."
                                             r"BlockModel"),
        ("tests.test_own_model:misnamed", r"returned a model named 'tiny'; its name must be "
                                          r"the entry point's, 'broken'"),
        ("tests.test_own_model:EXAMPLE", r"is a PosixPath, not a callable"),
    ],
)  # fmt: skip
def test_a_broken_entry_point_is_a_config_error_naming_it(
    fake_installed: Callable[..., list[int]], value: str, message: str
) -> None:
    fake_installed(broken=value)
    with pytest.raises(ConfigError, match=rf"^model 'broken': .*{message}"):
        get_model("broken")


def test_an_unknown_name_lists_the_built_in_and_installed_models(
    fake_installed: Callable[..., list[int]],
) -> None:
    fake_installed(**{"tiny-mlp": "ravnest_tiny_mlp.model:make_model"})
    with pytest.raises(ConfigError, match=r"unknown model 'gpt-9'; choose one of: .*bench-small"
                       r".*tiny-mlp.*; or install the package that declares it \(entry-point "
                       r"group ravnest_node.models\)"):  # fmt: skip
        get_model("gpt-9")


def test_models_command_lists_built_in_installed_and_broken(
    fake_installed: Callable[..., list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_installed(**{"tiny-mlp": "ravnest_tiny_mlp.model:make_model",
                      "broken": "tests.test_own_model:failing_factory",
                      "small": "ravnest_tiny_mlp.model:make_model"})  # fmt: skip
    rows = {row.name: row for row in models_command.model_rows()}
    assert rows["tiny"].source == "built-in" and rows["tiny"].blocks == 4
    assert rows["tiny"].parameters == get_model("tiny").num_parameters()
    mlp = rows["tiny-mlp"]
    assert mlp.source == "an unknown distribution (ravnest_tiny_mlp.model:make_model)"
    assert (mlp.blocks, mlp.parameters) == (6, get_model("tiny-mlp").num_parameters())
    assert rows["broken"].blocks is None and "RuntimeError: no GPU here" in rows["broken"].error
    hidden = [row for row in models_command.model_rows() if row.name == "small"]
    assert [row.source for row in hidden] == ["built-in", mlp.source]
    assert hidden[1].error == "ignored: a built-in model has that name"
    assert main(["models"]) == 0  # a broken package is listed, not fatal
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["MODEL", "BLOCKS", "PARAMETERS", "SOURCE"]
    line = next(line for line in table if line.startswith("tiny-mlp "))
    assert line.split()[:3] == ["tiny-mlp", "6", f"{mlp.parameters:,}"]
    assert any(line.startswith("broken ") and "no GPU here" in line for line in table)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package, pip-installed (no dependencies, no download) into a directory of
    its own, from a copy (pip leaves build files beside the source)."""
    tmp = tmp_path_factory.mktemp("own_model")
    source = shutil.copytree(
        EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(source)],
        check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    return site


def _with(site: Path) -> dict[str, str]:
    """NODE_ENV with `site` on the path (its node processes inherit it)."""
    path = os.pathsep.join(p for p in (str(site), NODE_ENV.get("PYTHONPATH", "")) if p)
    return NODE_ENV | {"PYTHONPATH": path}


@pytest.fixture
def in_this_process(site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The installed example visible to this process too (to read its checkpoints back)."""
    monkeypatch.syspath_prepend(str(site))
    registry.INSTALLED.reset()
    yield
    monkeypatch.undo()
    registry.INSTALLED.reset()


def test_three_node_processes_train_the_installed_model_exactly_like_one(
    tmp_path: Path, site: Path, in_this_process: None
) -> None:
    args = ("--model", "tiny-mlp", "--steps", "12", *SYNC)
    runs_args: dict[str, Sequence[str]] = {
        "one": ("--nodes", "1", *args),
        "three": ("--nodes", "3", *args),
    }
    summaries = demo_summaries(tmp_path, runs_args, env=_with(site))
    three = summaries["three"]
    assert three["model"] == "tiny-mlp" and three["nodes"] == 3
    assert three["final_loss"] < 0.7 * three["initial_loss"]
    runs = {name: demo_run(s, tmp_path / name) for name, s in summaries.items()}
    assert_same_training(runs["three"], runs["one"])
    assert_same_training(runs["three"], plain_training("tiny-mlp", 12))
    assert installed_models()["tiny-mlp"].origin == (
        "ravnest-tiny-mlp 0.1.0 (ravnest_tiny_mlp.model:make_model)"
    )


def test_a_node_without_the_model_refuses_and_names_the_package(
    tmp_path: Path, site: Path, procs: Procs
) -> None:
    _, ready = procs.start_node(
        tmp_path / "coordinator", "--swarm-size", "2", "--model", "tiny-mlp", env=_with(site)
    )
    lacking, _ = procs.start_node(tmp_path / "lacking", "--join", ready["address"])
    assert lacking.wait(60) == 1
    log = (tmp_path / "lacking" / "node.log").read_text()
    assert (
        "the swarm trains model 'tiny-mlp', which the package 'ravnest-tiny-mlp' "
        "provides; it is not installed on this node" in log
    )
    assert "Traceback" not in log


def test_the_docs_show_the_example_package_as_it_is() -> None:
    """docs/development.md ("Your own model") shows the files this test installs, verbatim."""
    doc = (EXAMPLE.parents[2] / "docs" / "development.md").read_text()
    section = doc.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    for name, lang in (("pyproject.toml", "toml"), ("ravnest_tiny_mlp/model.py", "python")):
        assert f"```{lang}\n{(EXAMPLE / name).read_text()}```" in section, name
    for command in (
        "pip install -e docs/examples/own_model",
        "ravnest-node models",
        "ravnest-node demo --model tiny-mlp",
        "ravnest-node start --model tiny-mlp",
    ):
        assert command in section


def test_only_a_package_name_from_the_coordinator_is_quoted() -> None:
    """JoinReply.model_package comes from the network: a node quotes it in its message only if
    it is a distribution name."""
    assert is_project_name("ravnest-tiny-mlp") and is_project_name("a.b_c-1")
    for text in ("", "x" * 101, "evil; rm -rf /", "-lead", "name\n", "pkg==1.0"):
        assert not is_project_name(text)
