"""Reading a Hugging Face ``tokenizer.json`` (or ``tokenizer_config.json``): the file, bounded
in size, as a JSON object, and its fields checked, each error a `ConfigError` that names where
in the file the field stands (``model.vocab``, ``pre_tokenizer.pretokenizers[1].behavior``...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ravnest_node.errors import ConfigError

__all__ = [
    "MAX_FILE_BYTES",
    "as_id",
    "as_list",
    "as_object",
    "bool_field",
    "list_field",
    "parse_object",
    "read_file",
    "str_field",
]

MAX_FILE_BYTES = 64 << 20
"""Largest tokenizer.json (or tokenizer_config.json) read; Llama 3's is about 9 MiB."""


def read_file(path: Path) -> bytes:
    """The bytes of the file at `path`; `ConfigError` if it cannot be read or is larger than
    `MAX_FILE_BYTES`."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the tokenizer file {path}: {exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB, not a tokenizer file")
    return data


def parse_object(data: bytes, path: Path) -> dict[str, Any]:
    """The JSON object in `data`, read from `path`; `ConfigError` naming `path` if it is not
    UTF-8 JSON or not an object."""
    try:
        spec = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: not a JSON file: {exc}") from exc
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a JSON {type(spec).__name__}, expected an object")
    return spec


def as_object(value: Any, where: str) -> dict[str, Any]:
    """`value`, the JSON object at `where`; `ConfigError` if it is something else."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object, got {_kind(value)}")
    return value


def as_list(value: Any, where: str) -> list[Any]:
    """`value`, the JSON list at `where`; `ConfigError` if it is something else."""
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a JSON list, got {_kind(value)}")
    return value


def list_field(spec: dict[str, Any], key: str, where: str) -> list[tuple[Any, str]]:
    """The items of the list ``spec[key]``, each with where it stands (``where.key[k]``);
    `ConfigError` if it is not a list."""
    at = f"{where}.{key}"
    return [(item, f"{at}[{k}]") for k, item in enumerate(as_list(spec.get(key), at))]


def str_field(spec: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    """The string ``spec[key]`` (`default` if it is absent); `ConfigError` if it is no string."""
    value = spec.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key} must be a string, got {_kind(value)}")
    return value


def bool_field(spec: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """The boolean ``spec[key]`` (`default` if it is absent); `ConfigError` if it is no
    boolean."""
    value = spec.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} must be true or false, got {_kind(value)}")
    return value


def as_id(value: Any, where: str) -> int:
    """`value`, the token id at `where`; `ConfigError` if it is not an int >= 0."""
    if type(value) is not int or value < 0:
        raise ConfigError(f"{where} must be a token id (an int >= 0), got {value!r:.60}")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} {value!r:.60}"
