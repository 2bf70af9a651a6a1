"""The settings loader: defaults < TOML < env < flags < overrides, and its one-line errors."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from ravnest_node.errors import ConfigError
from ravnest_node.settings import (
    add_arguments,
    env_name,
    field_docs,
    load,
    reference_markdown,
    to_env,
)


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainSettings:
    steps: int = 100
    """Optimizer steps to run before stopping."""
    lr: float = 0.01
    """Learning rate of the optimizer."""
    batch_size: int = 8
    """Samples per microbatch."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"train.steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")


@dataclass(kw_only=True, frozen=True, slots=True)
class NodeSettings:
    listen: str = "127.0.0.1:0"
    """Address the node's server binds to, host:port (port 0 picks a free one)."""
    state_dir: Path | None = None
    """Where checkpoints and the node identity live; none keeps everything in memory."""
    verbose: bool = False
    """Log every microbatch."""
    codec: Literal["none", "fp16"] = "none"
    """How activations are compressed on the wire."""
    peer: str = field(default="", metadata={"flag": "--join"})
    """Address of a running node to join; empty starts a new run."""
    train: TrainSettings = field(default_factory=TrainSettings)
    """How long and how fast to train."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Deep:
    depth: int = 1
    """How deep."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Middle:
    inner: Deep = field(default_factory=lambda: Deep(depth=7))
    """The deepest section, whose default instance differs from Deep()."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Outer:
    name: str
    """A required setting."""
    middle: Middle = field(default_factory=Middle)
    """A section holding a section."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Clash:
    steps: int = 1
    """Clashes with train.steps."""
    train: TrainSettings = field(default_factory=TrainSettings)
    """A section."""


def parse(argv: list[str], *, exclude: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ravnest-node")
    add_arguments(parser, NodeSettings, exclude=exclude)
    return parser.parse_args(argv)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_defaults_when_no_source_is_given() -> None:
    assert load(NodeSettings, env={}) == NodeSettings()


def test_precedence_defaults_toml_env_args_overrides(tmp_path: Path) -> None:
    toml = write(
        tmp_path,
        'listen = "toml:1"\ncodec = "fp16"\n[train]\nsteps = 10\nlr = 0.5\n',
    )
    env = {"RAVNEST_LISTEN": "env:2", "RAVNEST_TRAIN_STEPS": "20", "RAVNEST_TRAIN_LR": "0.25"}
    args = parse(["--listen", "flag:3", "--steps", "30"])
    settings = load(NodeSettings, args=args, env=env, toml_path=toml, overrides={"steps": 40})
    assert settings.train.batch_size == 8  # default
    assert settings.codec == "fp16"  # TOML over default
    assert settings.train.lr == 0.25  # env over TOML
    assert settings.listen == "flag:3"  # flag over env
    assert settings.train.steps == 40  # override over flag


def test_flags_not_given_stay_out_of_the_namespace() -> None:
    assert vars(parse([])) == {}
    assert vars(parse(["--steps", "5"])) == {"steps": 5}


def test_bool_flags_switch_both_ways() -> None:
    assert parse(["--verbose"]).verbose is True
    assert parse(["--no-verbose"]).verbose is False
    settings = load(NodeSettings, args=parse(["--no-verbose"]), env={"RAVNEST_VERBOSE": "yes"})
    assert settings.verbose is False


def test_a_bool_flag_named_no_something_means_what_it_says() -> None:
    """`--no-inbound` is the switch of `no_inbound`: it sets it (argparse's own boolean action
    would read any `--no-` as off), and `--no-no-inbound` clears it."""
    from ravnest_node.cli.main import _parser

    def start(*flags: str) -> object:
        return _parser().parse_args(["start", "--join", "c:1", *flags]).no_inbound

    assert start("--no-inbound") is True
    assert start("--no-no-inbound") is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("1", True),
        ("YES", True),
        ("on", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("Off", False),
    ],
)
def test_env_bool_words(text: str, expected: bool) -> None:
    assert load(NodeSettings, env={"RAVNEST_VERBOSE": text}).verbose is expected


def test_env_bool_rejects_other_words() -> None:
    with pytest.raises(ConfigError, match=r"^RAVNEST_VERBOSE='maybe': expected a boolean \("):
        load(NodeSettings, env={"RAVNEST_VERBOSE": "maybe"})


def test_literal_choices_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--codec", "fp16"]).codec == "fp16"
    with pytest.raises(SystemExit):
        parse(["--codec", "zstd"])
    assert "argument --codec: expected one of 'none', 'fp16', got 'zstd'" in capsys.readouterr().err


def test_literal_choices_from_env_and_toml(tmp_path: Path) -> None:
    assert load(NodeSettings, env={"RAVNEST_CODEC": "fp16"}).codec == "fp16"
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={"RAVNEST_CODEC": "zstd"})
    assert str(info.value) == "RAVNEST_CODEC='zstd': expected one of 'none', 'fp16'"
    toml = write(tmp_path, 'codec = "zstd"\n')
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={}, toml_path=toml)
    assert str(info.value) == f"config file {toml}: codec must be one of 'none', 'fp16', got 'zstd'"


def test_optional_none_from_every_source(tmp_path: Path) -> None:
    assert parse(["--state-dir", "none"]).state_dir is None
    assert parse(["--state-dir", "/srv/node"]).state_dir == Path("/srv/node")
    assert load(NodeSettings, env={"RAVNEST_STATE_DIR": "/srv/node"}).state_dir == Path("/srv/node")
    toml = write(tmp_path, 'state_dir = "/srv/node"\n')
    assert load(NodeSettings, env={"RAVNEST_STATE_DIR": "None"}, toml_path=toml).state_dir is None
    toml = write(tmp_path, 'state_dir = "none"\n')
    assert load(NodeSettings, env={}, toml_path=toml).state_dir is None


def test_literal_none_is_a_choice_not_none_when_not_optional() -> None:
    assert load(NodeSettings, env={"RAVNEST_CODEC": "none"}).codec == "none"
    assert parse(["--codec", "none"]).codec == "none"


def test_metadata_flag_overrides_the_flag_but_not_the_dest() -> None:
    assert parse(["--join", "10.0.0.1:7000"]).peer == "10.0.0.1:7000"
    with pytest.raises(SystemExit):
        parse(["--peer", "x"])


def test_exclude_hides_a_flag_and_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit):
        parse(["--listen", "x"], exclude=("listen",))
    with pytest.raises(TypeError, match="lsiten"):
        parse([], exclude=("lsiten",))


def test_help_shows_docstring_default_and_section_group() -> None:
    parser = argparse.ArgumentParser(prog="ravnest-node")
    add_arguments(parser, NodeSettings)
    help_text = " ".join(parser.format_help().split())
    assert "Learning rate of the optimizer. (default: 0.01)" in help_text
    assert "(port 0 picks a free one). (default: 127.0.0.1:0)" in help_text
    assert "--verbose, --no-verbose" in help_text
    assert "{none,fp16}" in help_text
    titles = [group.title for group in parser._action_groups]
    assert "train" in titles


def test_unknown_ravnest_env_variables_are_ignored() -> None:
    env = {"RAVNEST_SOMETHING_ELSE": "x", "RAVNEST_TRAIN_STPES": "abc", "HOME": "/root"}
    assert load(NodeSettings, env=env) == NodeSettings()


def test_env_bad_integer() -> None:
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={"RAVNEST_TRAIN_STEPS": "abc"})
    assert str(info.value) == "RAVNEST_TRAIN_STEPS='abc': expected an integer"


def test_bad_integer_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--steps", "abc"])
    assert "argument --steps: expected an integer, got 'abc'" in capsys.readouterr().err


def test_toml_syntax_error(tmp_path: Path) -> None:
    toml = write(tmp_path, "stpes 3\n")
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={}, toml_path=toml)
    assert str(info.value) == (
        f"config file {toml}: Expected '=' after a key in a key/value pair (at line 1, column 7)"
    )


def test_toml_unknown_setting(tmp_path: Path) -> None:
    toml = write(tmp_path, "[train]\nstpes = 3\n")
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={}, toml_path=toml)
    assert str(info.value) == (
        f"config file {toml}: unknown setting 'stpes' in [train] (known: batch_size, lr, steps)"
    )
    toml = write(tmp_path, "verbos = true\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'verbos' at the top level \(known: "):
        load(NodeSettings, env={}, toml_path=toml)


def test_toml_wrong_types(tmp_path: Path) -> None:
    cases = {
        'steps = "ten"': "[train] steps must be an integer, got str",
        "steps = true": "[train] steps must be an integer, got bool",
        "lr = false": "[train] lr must be a number, got bool",
    }
    for line, message in cases.items():
        toml = write(tmp_path, f"[train]\n{line}\n")
        with pytest.raises(ConfigError) as info:
            load(NodeSettings, env={}, toml_path=toml)
        assert str(info.value) == f"config file {toml}: {message}"
    toml = write(tmp_path, "train = 3\n")
    with pytest.raises(ConfigError, match=r"train must be a table \(\[train\]\), got int$"):
        load(NodeSettings, env={}, toml_path=toml)


def test_toml_int_is_accepted_as_float(tmp_path: Path) -> None:
    lr = load(NodeSettings, env={}, toml_path=write(tmp_path, "[train]\nlr = 1\n")).train.lr
    assert lr == 1.0
    assert isinstance(lr, float)


def test_missing_toml_file(tmp_path: Path) -> None:
    toml = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={}, toml_path=toml)
    assert str(info.value) == f"config file {toml}: not found"


def test_post_init_errors_propagate_unchanged() -> None:
    with pytest.raises(ConfigError) as info:
        load(NodeSettings, env={"RAVNEST_TRAIN_STEPS": "0"})
    assert str(info.value) == "train.steps must be at least 1, got 0"


def test_nested_sections_chain_env_names_and_tables(tmp_path: Path) -> None:
    assert env_name(("middle", "inner", "depth")) == "RAVNEST_MIDDLE_INNER_DEPTH"
    assert load(Outer, env={"RAVNEST_NAME": "n"}).middle.inner.depth == 7  # section's default
    got = load(Outer, env={"RAVNEST_NAME": "n", "RAVNEST_MIDDLE_INNER_DEPTH": "3"})
    assert got.middle.inner.depth == 3
    toml = write(tmp_path, 'name = "t"\n[middle.inner]\ndepth = 4\n')
    expected = Outer(name="t", middle=Middle(inner=Deep(depth=4)))
    assert load(Outer, env={}, toml_path=toml) == expected
    parser = argparse.ArgumentParser()
    add_arguments(parser, Outer)
    assert "middle.inner" in [group.title for group in parser._action_groups]


def test_missing_required_setting() -> None:
    with pytest.raises(ConfigError) as info:
        load(Outer, env={})
    assert str(info.value) == (
        "missing required setting name: give --name, RAVNEST_NAME or name in the config file"
    )


def test_unknown_override_is_a_bug() -> None:
    with pytest.raises(TypeError, match="stpes"):
        load(NodeSettings, env={}, overrides={"stpes": 1})


def test_duplicate_leaf_names_are_rejected() -> None:
    with pytest.raises(TypeError, match=r"steps and train\.steps"):
        add_arguments(argparse.ArgumentParser(), Clash)
    with pytest.raises(TypeError):
        load(Clash, env={})


def test_env_name() -> None:
    assert env_name(("train", "steps")) == "RAVNEST_TRAIN_STEPS"
    assert env_name(("listen",)) == "RAVNEST_LISTEN"


def test_field_docs() -> None:
    assert field_docs(TrainSettings) == {
        "steps": "Optimizer steps to run before stopping.",
        "lr": "Learning rate of the optimizer.",
        "batch_size": "Samples per microbatch.",
    }
    assert field_docs(NodeSettings)["train"] == "How long and how fast to train."


def test_reference_markdown_lists_every_setting() -> None:
    text = reference_markdown(NodeSettings)
    for key, flag, env in [
        ("listen", "--listen", "RAVNEST_LISTEN"),
        ("state_dir", "--state-dir", "RAVNEST_STATE_DIR"),
        ("verbose", "--verbose", "RAVNEST_VERBOSE"),
        ("codec", "--codec", "RAVNEST_CODEC"),
        ("peer", "--join", "RAVNEST_PEER"),
        ("train.steps", "--steps", "RAVNEST_TRAIN_STEPS"),
        ("train.lr", "--lr", "RAVNEST_TRAIN_LR"),
        ("train.batch_size", "--batch-size", "RAVNEST_TRAIN_BATCH_SIZE"),
    ]:
        assert f"| `{key}` | `{flag}`" in text
        assert f"`{env}`" in text
    assert "`--verbose` / `--no-verbose`" in text
    assert "| path or `none` | `none` |" in text
    assert "Learning rate of the optimizer." in text
    assert len(text.splitlines()) == 2 + 8


@dataclass(kw_only=True, frozen=True, slots=True)
class Repeated:
    peers: tuple[str, ...] = field(default=(), metadata={"flag": "--peer"})
    """Bootstrap addresses."""
    ports: tuple[int, ...] = (1, 2)
    """Ports."""


def test_tuple_settings_repeat_the_flag_split_the_env_and_take_toml_arrays(
    tmp_path: Path,
) -> None:
    parser = argparse.ArgumentParser(prog="ravnest-node")
    add_arguments(parser, Repeated)
    args = parser.parse_args(["--peer", "a:1", "--peer", "b:2"])
    assert load(Repeated, args=args, env={"RAVNEST_PEERS": "x:1"}).peers == ("a:1", "b:2")
    assert load(Repeated, env={"RAVNEST_PEERS": " a:1, b:2,", "RAVNEST_PORTS": ""}) == Repeated(
        peers=("a:1", "b:2"), ports=()
    )
    assert load(Repeated, env={}, toml_path=write(tmp_path, "ports = [7, 8]\n")).ports == (7, 8)
    with pytest.raises(ConfigError, match="RAVNEST_PORTS"):
        load(Repeated, env={"RAVNEST_PORTS": "1,x"})
    with pytest.raises(ConfigError, match="ports must be a list, each an integer, got int"):
        load(Repeated, env={}, toml_path=write(tmp_path, "ports = 7\n"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--ports", "x"])
    text = reference_markdown(Repeated)
    assert "| `ports` | `--ports` | `RAVNEST_PORTS` | list of int (repeat the flag" in text
    assert "| `1,2` |" in text and "| `''` |" in text


@dataclass(kw_only=True, frozen=True, slots=True)
class Relaying:
    relay: str = ""
    """The relay to go through."""
    relay_ports: tuple[int, ...] = ()
    """Ports a relay opens."""

    def __post_init__(self) -> None:
        if self.relay_ports and not self.relay:
            raise ConfigError("relay_ports: only with a relay")


@dataclass(kw_only=True, frozen=True, slots=True)
class Flat:
    listen: str = "127.0.0.1:0"
    """The address."""
    relaying: Relaying = field(default_factory=Relaying, metadata={"flat": True})
    """Relay settings, addressed as top-level ones."""
    quiet: bool = False
    """After the flat section."""
    train: TrainSettings = field(default_factory=TrainSettings)
    """A table of its own."""


def test_a_flat_sections_leaves_are_addressed_as_top_level_fields(tmp_path: Path) -> None:
    toml = write(tmp_path, 'relay = "r:1"\nrelay_ports = [7]\n[train]\nsteps = 3\n')
    got = load(Flat, env={}, toml_path=toml)
    assert got.relaying == Relaying(relay="r:1", relay_ports=(7,)) and got.train.steps == 3
    env = {"RAVNEST_RELAY": "e:2", "RAVNEST_RELAY_PORTS": "8,9", "RAVNEST_RELAYING_RELAY": "x:1"}
    assert load(Flat, env=env).relaying == Relaying(relay="e:2", relay_ports=(8, 9))
    assert to_env(got) == {
        "RAVNEST_LISTEN": "127.0.0.1:0",
        "RAVNEST_RELAY": "r:1",
        "RAVNEST_RELAY_PORTS": "7",
        "RAVNEST_QUIET": "false",
        "RAVNEST_TRAIN_STEPS": "3",
        "RAVNEST_TRAIN_LR": "0.01",
        "RAVNEST_TRAIN_BATCH_SIZE": "8",
    }
    assert load(Flat, env=to_env(got)) == got
    parser = argparse.ArgumentParser()
    add_arguments(parser, Flat)
    args = parser.parse_args(["--relay", "f:3", "--quiet"])
    assert load(Flat, args=args, env={}) == Flat(relaying=Relaying(relay="f:3"), quiet=True)
    assert "relaying" not in [group.title for group in parser._action_groups]
    assert load(Flat, env={}, overrides={"relay": "o:4"}).relaying.relay == "o:4"
    with pytest.raises(ConfigError, match="only with a relay"):  # the section's own check
        load(Flat, env={"RAVNEST_RELAY_PORTS": "7"})
    with pytest.raises(ConfigError, match="unknown setting 'relaying' at the top level"):
        load(Flat, env={}, toml_path=write(tmp_path, '[relaying]\nrelay = "r:1"\n'))
    rows = reference_markdown(Flat).splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| `listen`",
        "| `relay`",
        "| `relay_ports`",
        "| `quiet`",
        "| `train.steps`",
        "| `train.lr`",
        "| `train.batch_size`",
    ]
    assert "| `relay` | `--relay` | `RAVNEST_RELAY` |" in reference_markdown(Flat)


@dataclass(kw_only=True, frozen=True, slots=True)
class FlatLeaf:
    size: int = field(default=0, metadata={"flat": True})
    """Not a section."""


def test_only_a_section_can_be_flat() -> None:
    with pytest.raises(TypeError, match="only a section can be flat"):
        load(FlatLeaf, env={})
