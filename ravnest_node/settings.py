"""Settings loader: one dataclass tree, four sources.

A node's configuration is a tree of frozen dataclasses (STYLE.md, "Config"); a field whose type
is another such dataclass is a *section*. Each leaf field can be set four ways, lowest precedence
first:

1. the dataclass default (or the section's default instance),
2. a TOML file: top-level fields at the top, a section's fields in its ``[section]`` table,
3. an environment variable ``RAVNEST_<FIELD>``, or ``RAVNEST_<SECTION>_<FIELD>`` in a section,
4. a command-line flag ``--<field-with-dashes>`` (leaf names are unique across the tree),

A *flat* section (its field's metadata has ``"flat": True``) groups fields in the code only:
its leaves are addressed as if they were fields of the section holding it (a flat section of
the root: top-level TOML keys, ``RAVNEST_<FIELD>``, no help group), so that settings can move
into a section without any config file, environment or command line changing.

and code may pin a field above all of them with ``load(..., overrides=...)``. Leaf types are
``int``, ``float``, ``str``, ``bool``, ``pathlib.Path``, a ``Literal`` of strings, ``X | None``
of those, or ``tuple[X, ...]`` of those (a repeatable flag, a TOML array, a comma-separated
environment variable); in text sources and TOML the word ``none`` means None for an optional field.

A wrong value in any source raises `ConfigError` with one line naming the source. A config tree
this module cannot handle (duplicate leaf names, an unsupported type) raises `TypeError`: that is
a bug in the config classes, not in the user's input.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import os
import textwrap
import tomllib
import types
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from ravnest_node.errors import ConfigError

T = TypeVar("T")

_MISSING: Any = dataclasses.MISSING
_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})
_NOUNS: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean",
    Path: "a path",
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Kind:
    """The value type of a leaf: a scalar type, or string choices; maybe optional."""

    base: type
    choices: tuple[str, ...] = ()
    optional: bool = False
    many: bool = False
    """A tuple of such values (a repeatable flag)."""

    @property
    def item(self) -> _Kind:
        """The kind of one value of a tuple."""
        return dataclasses.replace(self, many=False)

    def expected(self, *, text: bool) -> str:
        """What a valid value looks like, for 'expected ...' and 'must be ...' messages."""
        if self.many:
            each = self.item.expected(text=text)
            return f"comma-separated values, each {each}" if text else f"a list, each {each}"
        if self.choices:
            noun = "one of " + ", ".join(repr(choice) for choice in self.choices)
        elif self.base is bool and text:
            noun = "a boolean (true/false, 1/0, yes/no, on/off)"
        else:
            noun = _NOUNS[self.base]
        return f"{noun} or 'none'" if self.optional else noun


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    path: tuple[str, ...]
    """Where users address it: TOML tables and key, the env variable's parts, the reference."""
    kind: _Kind
    default: Any  # dataclasses.MISSING when the field is required
    doc: str
    flag: str

    @property
    def name(self) -> str:
        return self.path[-1]


@dataclasses.dataclass(frozen=True, slots=True)
class _Section:
    cls: type
    name: str
    """Its field's name in the parent section ("" for the root)."""
    path: tuple[str, ...]
    """Where users address it: its parent's path, and its name unless it is flat."""
    doc: str
    flat: bool
    children: tuple[_Leaf | _Section, ...]
    """Its fields, in field order."""

    def own_leaves(self) -> Iterator[_Leaf]:
        """The leaves addressed in this section's table: its own and, where they stand in
        field order, those of its flat sections."""
        for child in self.children:
            if isinstance(child, _Leaf):
                yield child
            elif child.flat:
                yield from child.own_leaves()

    def subtables(self) -> Iterator[_Section]:
        """The sections that are tables directly inside this one (through flat ones too)."""
        for child in self.children:
            if isinstance(child, _Section):
                yield from child.subtables() if child.flat else (child,)

    def all_sections(self) -> Iterator[_Section]:
        """This table and every table below it, depth first, in field order (flat sections
        are part of their parent's table)."""
        yield self
        for section in self.subtables():
            yield from section.all_sections()

    def all_leaves(self) -> Iterator[_Leaf]:
        for section in self.all_sections():
            yield from section.own_leaves()


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (and its dataclass bases): field name -> its first
    paragraph, on one line.

    Parsed from the class source; a class without source (defined in a REPL) has none: ``{}``.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        class_def = ast.parse(source).body[0]
        if not isinstance(class_def, ast.ClassDef):
            continue
        for node, after in itertools.pairwise(class_def.body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
                and after.value.value.strip()
            ):
                paragraph = inspect.cleandoc(after.value.value).split("\n\n")[0]
                docs[node.target.id] = " ".join(paragraph.split())
    return docs


def env_name(path: Sequence[str]) -> str:
    """The environment variable of a setting: ("train", "steps") -> "RAVNEST_TRAIN_STEPS"."""
    if not path:
        raise ValueError("a setting path needs at least one name")
    return "RAVNEST_" + "_".join(part.upper() for part in path)


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, *, exclude: Collection[str] = ()
) -> None:
    """Add one ``--flag`` per leaf of the tree ``cls``, except the leaf names in ``exclude``.

    Flags default to ``argparse.SUPPRESS``, so the namespace holds only flags actually given,
    under the leaf name as dest; pass it to `load`. Each section gets an argument group.
    Raises TypeError if the tree is not supported or ``exclude`` names an unknown leaf.
    """
    tree = _tree(cls)
    unknown = sorted(set(exclude) - {leaf.name for leaf in tree.all_leaves()})
    if unknown:
        raise TypeError(f"cannot exclude {', '.join(unknown)}: not settings of {cls.__name__}")
    for section in tree.all_sections():
        leaves = [leaf for leaf in section.own_leaves() if leaf.name not in exclude]
        if not leaves:
            continue
        add: Callable[..., argparse.Action] = parser.add_argument
        if section.path:
            title = ".".join(section.path)
            add = parser.add_argument_group(title, section.doc or None).add_argument
        for leaf in leaves:
            _add_flag(add, leaf)


def load(
    cls: type[T],
    *,
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    toml_path: Path | None = None,
    overrides: Mapping[str, object] | None = None,
) -> T:
    """Build the config tree ``cls`` from defaults < TOML file < env < args < overrides.

    ``env`` defaults to ``os.environ`` (pass ``{}`` to ignore the environment); unknown
    ``RAVNEST_*`` variables are ignored. ``args`` is a namespace from a parser that
    `add_arguments` filled. ``overrides`` maps leaf names to already-typed values.
    Raises ConfigError (one line) for a bad source or a missing required setting; errors from
    the classes' ``__post_init__`` propagate unchanged. Raises TypeError for an unknown override.
    """
    tree = _tree(cls)
    leaves = list(tree.all_leaves())
    values: dict[tuple[str, ...], object] = {}
    if toml_path is not None:
        _collect_toml(_read_toml(toml_path), tree, f"config file {toml_path}", values)
    environ = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    for leaf in leaves:  # the flag, read second, wins over the env variable
        name = env_name(leaf.path)
        if name in environ:
            text = environ[name]
            try:
                values[leaf.path] = _parse_text(text, leaf.kind)
            except ValueError as exc:
                raise ConfigError(f"{name}={text!r}: {exc}") from None
        if leaf.name in given:
            try:
                values[leaf.path] = _check_value(given[leaf.name], leaf.kind)
            except ValueError as exc:
                raise ConfigError(f"{leaf.flag} {exc}") from None
    by_name = {leaf.name: leaf for leaf in leaves}
    for name, value in (overrides or {}).items():
        if name not in by_name:
            raise TypeError(f"override {name!r} is not a setting of {cls.__name__}")
        try:
            values[by_name[name].path] = _check_value(value, by_name[name].kind)
        except ValueError as exc:
            raise TypeError(f"override {name!r} {exc}") from None
    for leaf in leaves:
        if values.get(leaf.path, leaf.default) is _MISSING:
            raise ConfigError(
                f"missing required setting {'.'.join(leaf.path)}: give {leaf.flag}, "
                f"{env_name(leaf.path)} or {leaf.name} in the config file"
            )
    return cast(T, _build(tree, values))


def reference_markdown(cls: type) -> str:
    """A markdown table of every setting of ``cls``: TOML key, flag, env variable, type, default
    and description (for docs/configuration.md)."""
    rows = [
        "| Setting | Flag | Environment | Type | Default | Description |",
        "|---|---|---|---|---|---|",
    ]
    for leaf in _tree(cls).all_leaves():
        flag = f"`{leaf.flag}`"
        if _is_switch(leaf.kind):
            flag += f" / `--no-{leaf.flag.removeprefix('--')}`"
        if leaf.kind.choices:
            type_name = "one of " + ", ".join(f"`{choice}`" for choice in leaf.kind.choices)
        else:
            type_name = "path" if leaf.kind.base is Path else leaf.kind.base.__name__
        if leaf.kind.optional:
            type_name += " or `none`"
        if leaf.kind.many:
            type_name = f"list of {type_name} (repeat the flag; comma-separated in the environment)"
        default = "*required*" if leaf.default is _MISSING else f"`{_show(leaf.default)}`"
        cells = [
            f"`{'.'.join(leaf.path)}`",
            flag,
            f"`{env_name(leaf.path)}`",
            type_name,
            default,
            leaf.doc,
        ]
        rows.append("| " + " | ".join(cell.replace("|", r"\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _tree(cls: type) -> _Section:
    """Walk the config classes once; raises TypeError for a tree this module cannot handle."""
    root = _section(cls, "", (), "", _MISSING, flat=False)
    seen: dict[str, tuple[str, ...]] = {}
    for leaf in root.all_leaves():
        for key in (leaf.name, leaf.flag, env_name(leaf.path)):
            if key in seen and seen[key] != leaf.path:
                raise TypeError(
                    f"{cls.__name__}: settings {'.'.join(seen[key])} and {'.'.join(leaf.path)} "
                    f"both use {key!r}; leaf names, flags and env variables must be unique"
                )
            seen[key] = leaf.path
    return root


NOT_A_SETTING = {"setting": False}
"""A config field's metadata that keeps it out of the settings (no flag, no variable, no
file key), e.g. a key the daemon hands its transport (`TransportConfig.node_key`)."""


def is_setting(field: dataclasses.Field[Any]) -> bool:
    """Whether a config field is a setting (not marked NOT_A_SETTING)."""
    return bool(field.metadata.get("setting", True))


def _section(
    cls: type, name: str, path: tuple[str, ...], doc: str, instance: Any, *, flat: bool
) -> _Section:
    """One section of the tree; ``instance`` is its default value, if the parent field has one."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    children: list[_Leaf | _Section] = []
    for field in dataclasses.fields(cls):
        if not field.init or not is_setting(field):
            continue
        hint = hints[field.name]
        if instance is not _MISSING:
            default = getattr(instance, field.name)
        elif field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = _MISSING
        sub_path = (*path, field.name)
        sub_doc = docs.get(field.name, "")
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            sub_flat = bool(field.metadata.get("flat", False))
            sub = path if sub_flat else sub_path
            children.append(_section(hint, field.name, sub, sub_doc, default, flat=sub_flat))
            continue
        if "flat" in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name}: only a section can be flat")
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        if not (isinstance(flag, str) and flag.startswith("--")):
            raise TypeError(f"{cls.__name__}.{field.name}: flag {flag!r} must start with '--'")
        children.append(_Leaf(sub_path, _kind(hint, sub_path), default, sub_doc, flag))
    return _Section(cls, name, path, doc, flat, tuple(children))


def _kind(hint: Any, path: tuple[str, ...]) -> _Kind:
    if get_origin(hint) is tuple:
        args = get_args(hint)
        item = _kind(args[0], path) if len(args) == 2 and args[1] is Ellipsis else None
        if item is None or item.optional or item.many:
            raise TypeError(f"{'.'.join(path)}: a tuple setting must be tuple[X, ...] of one type")
        return dataclasses.replace(item, many=True)
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        members = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(members) == 1:
            hint, optional = members[0], True
    if get_origin(hint) is Literal and all(isinstance(arg, str) for arg in get_args(hint)):
        choices = get_args(hint)
        if optional and "none" in choices:
            raise TypeError(f"{'.'.join(path)}: 'none' cannot be both a choice and None")
        return _Kind(str, choices, optional)
    if hint in _NOUNS:
        return _Kind(hint, (), optional)
    raise TypeError(
        f"{'.'.join(path)}: unsupported setting type {hint!r} "
        "(use int, float, str, bool, Path, a Literal of strings, or one of those | None)"
    )


def _parse_text(text: str, kind: _Kind) -> object:
    """Convert text from a flag or env variable; ValueError says what was expected."""
    if kind.many:
        parts = (part.strip() for part in text.split(","))
        return tuple(_parse_text(part, kind.item) for part in parts if part)
    word = text.strip().lower()
    if kind.optional and word == "none":
        return None
    try:
        if kind.choices:
            if text in kind.choices:
                return text
        elif kind.base is bool:
            if word in _TRUE_WORDS or word in _FALSE_WORDS:
                return word in _TRUE_WORDS
        elif kind.base is int:
            return int(text)
        elif kind.base is float:
            return float(text)
        elif kind.base is Path:
            if text:
                return Path(text)
        else:
            return text
    except ValueError:
        pass
    raise ValueError(f"expected {kind.expected(text=True)}")


def _check_value(value: object, kind: _Kind) -> object:
    """Check an already-typed value (TOML, argparse, override); ValueError says what is wrong."""
    if kind.many:
        if not isinstance(value, list | tuple):
            raise ValueError(f"must be {kind.expected(text=False)}, got {type(value).__name__}")
        return tuple(_check_value(item, kind.item) for item in value)
    if value is None and kind.optional:
        return None
    if kind.choices:
        ok = isinstance(value, str) and value in kind.choices
    elif kind.base is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    elif kind.base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind.base is Path and isinstance(value, str) and value:
        value, ok = Path(value), True
    else:
        ok = isinstance(value, kind.base)
    if not ok:
        # A string of the right type but not a valid one shows itself; anything else its type.
        right_type = isinstance(value, str) and kind.base in (str, Path)
        got = repr(value) if right_type else type(value).__name__
        raise ValueError(f"must be {kind.expected(text=False)}, got {got}")
    return value


def _read_toml(path: Path) -> dict[str, Any]:
    where = f"config file {path}"
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{where}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror})") from None


def _collect_toml(
    table: Mapping[str, Any], section: _Section, where: str, out: dict[tuple[str, ...], object]
) -> None:
    children: dict[str, _Leaf | _Section] = {leaf.name: leaf for leaf in section.own_leaves()}
    children |= {sub.name: sub for sub in section.subtables()}
    dotted = ".".join(section.path)
    for key, value in table.items():
        child = children.get(key)
        if child is None:
            place = f"in [{dotted}]" if section.path else "at the top level"
            known = ", ".join(sorted(children))
            raise ConfigError(f"{where}: unknown setting {key!r} {place} (known: {known})")
        if isinstance(child, _Section):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{where}: {'.'.join(child.path)} must be a table "
                    f"([{'.'.join(child.path)}]), got {type(value).__name__}"
                )
            _collect_toml(value, child, where, out)
            continue
        if child.kind.optional and isinstance(value, str) and value.lower() == "none":
            value = None
        try:
            out[child.path] = _check_value(value, child.kind)
        except ValueError as exc:
            prefix = f"[{dotted}] " if section.path else ""
            raise ConfigError(f"{where}: {prefix}{key} {exc}") from None


def _build(section: _Section, values: Mapping[tuple[str, ...], object]) -> object:
    kwargs = {
        child.name: (
            _build(child, values)
            if isinstance(child, _Section)
            else values.get(child.path, child.default)
        )
        for child in section.children
    }
    return section.cls(**kwargs)


def _is_switch(kind: _Kind) -> bool:
    """A plain bool becomes a --name/--no-name switch; `bool | None` takes a value instead."""
    return kind.base is bool and not kind.optional and not kind.many


def _show(value: object) -> str:
    """A default as a person would type it in a flag or env variable."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(_show(item) for item in value) if value else "''"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if value != "" else "''"


class _Switch(argparse.Action):
    """``--flag`` sets True and ``--no-flag`` False. Unlike argparse.BooleanOptionalAction,
    which sets False for any option that starts with ``--no-``, this is right for a flag that
    itself does (``--no-inbound`` is True, ``--no-no-inbound`` False)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self._flag = option_strings[0]
        negative = "--no-" + self._flag.removeprefix("--")
        super().__init__([self._flag, negative], dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, option_string == self._flag)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _add_flag(add: Callable[..., argparse.Action], leaf: _Leaf) -> None:
    note = "required" if leaf.default is _MISSING else f"default: {_show(leaf.default)}"
    help_text = f"{leaf.doc} ({note})".strip().replace("%", "%%")
    options: dict[str, Any] = {"dest": leaf.name, "default": argparse.SUPPRESS, "help": help_text}
    if _is_switch(leaf.kind):
        options["action"] = _Switch
    elif leaf.kind.many:  # each use of the flag adds one value
        options["action"] = "append"
        options["type"] = functools.partial(_parse_flag, leaf.kind.item)
        options["metavar"] = leaf.flag.removeprefix("--").replace("-", "_").upper()
    else:
        options["type"] = functools.partial(_parse_flag, leaf.kind)
        options["metavar"] = leaf.flag.removeprefix("--").replace("-", "_").upper()
    if leaf.kind.choices:
        none: tuple[str, ...] = ("none",) if leaf.kind.optional else ()
        # _parse_flag maps 'none' to None before argparse checks the choices
        options["choices"] = leaf.kind.choices + ((None,) if none else ())
        options["metavar"] = "{" + ",".join(leaf.kind.choices + none) + "}"
    add(leaf.flag, **options)


def _parse_flag(kind: _Kind, text: str) -> object:
    """argparse ``type=`` of a leaf: argparse prints the message after the flag's name."""
    try:
        return _parse_text(text, kind)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def to_env(config: object, prefix: Sequence[str] = ()) -> dict[str, str]:
    """Every leaf of a config instance as ``RAVNEST_*`` variables, which `load` reads back into
    an equal config: how a parent process hands its settings to the node processes it starts.
    `prefix` is the path of `config` inside the tree that will read them (e.g. ``("train",)``);
    a flat section's fields are addressed as its parent's (its field's metadata says "flat")."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"{config!r} is not a dataclass instance")
    out: dict[str, str] = {}
    for f in dataclasses.fields(config):
        if not is_setting(f):
            continue
        value = getattr(config, f.name)
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= to_env(value, prefix if f.metadata.get("flat", False) else path)
        elif value is None:
            out[env_name(path)] = "none"
        elif isinstance(value, bool):
            out[env_name(path)] = "true" if value else "false"
        elif isinstance(value, tuple):
            out[env_name(path)] = ",".join(str(item) for item in value)
        else:
            out[env_name(path)] = str(value)
    return out
