"""The weights of a Hugging Face model directory, read through the `safetensors` library.

A directory holds either ``model.safetensors`` or ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file name}}``) beside its shards. `index_directory`
maps every tensor name to its file; `load_tensors` reads only the tensors asked for, through
`safetensors.safe_open` (memory-mapped: a stage reads its own blocks out of a model of any
size), each straight onto the device asked for, in the dtype the file stores it in.

The library checks each file's header before it hands out a tensor; what it lacks is kept
here: the sharded index (a shard must be a plain file name inside the directory, and hold
the tensors the index puts in it), and errors that name the file and the tensor. Every
failure is a `ConfigError` (the library's own message included where it refused a file).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ravnest_node.errors import ConfigError

__all__ = [
    "INDEX_FILE",
    "MAX_INDEX_BYTES",
    "SINGLE_FILE",
    "index_directory",
    "load_tensors",
    "tensor_shape",
]

SINGLE_FILE = "model.safetensors"
"""The file name of an unsharded model in a Hugging Face model directory."""

INDEX_FILE = "model.safetensors.index.json"
"""The file name of a sharded model's index in a Hugging Face model directory."""

MAX_INDEX_BYTES = 100 * 1024 * 1024
"""Largest index file accepted, in bytes: more is taken as a hostile file."""


def _open(file: Path, device: torch.device | None = None) -> Any:
    """`safe_open` of `file` (framework "pt", onto `device`); ConfigError naming the file,
    with the library's message, if it refuses it."""
    try:
        return safe_open(file, framework="pt", device=_device_name(device))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{file}: not a readable safetensors file: {exc}") from None


_DIRECT = ("cpu", "cuda", "mps", "xpu", "npu")
"""Device types safetensors reads onto; a tensor for any other (the meta device of tests and
counts) is read on the host and moved."""


def _device_name(device: torch.device | None) -> str:
    """The device as safetensors names it ("cpu", "cuda:0", ...)."""
    if device is None or device.type not in _DIRECT:
        return "cpu"
    if device.type == "cuda" and device.index is None:  # the current card, as torch takes it
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def index_directory(directory: Path) -> dict[str, Path]:
    """Every tensor of the Hugging Face model directory `directory`: name -> its file.

    Reads `SINGLE_FILE`'s header if it is there, else `INDEX_FILE` and its shards' headers.
    ConfigError if neither is there, if the index is malformed or names a shard that is not a
    plain file name inside the directory (no ``..``, no separators), a shard that is missing,
    or a tensor its shard lacks, or if the library refuses a file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory")
    single = directory / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(_open(single).keys(), single)
    index = directory / INDEX_FILE
    if not index.is_file():
        raise ConfigError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    return _read_index(index)


def _read_index(index: Path) -> dict[str, Path]:
    """The tensors of a sharded directory by its `index` file (see `index_directory`)."""
    try:
        with open(index, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
        if len(raw) > MAX_INDEX_BYTES:
            raise ConfigError(f"{index}: over the limit of {MAX_INDEX_BYTES} bytes")
        content = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{index}: cannot read it as JSON: {exc}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise ConfigError(f'{index}: has no "weight_map" object')
    shards: dict[str, set[str]] = {}
    result: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _is_plain_file_name(shard):
            raise ConfigError(
                f"{index}: tensor {_short(name)} is in {_short(shard)}, which is not a plain "
                "file name inside the model directory"
            )
        path = index.parent / shard
        if shard not in shards:
            if not path.is_file():
                raise ConfigError(f"{index}: shard {_short(shard)} of tensor {_short(name)} "
                                  "is missing")  # fmt: skip
            shards[shard] = set(_open(path).keys())
        if name not in shards[shard]:
            raise ConfigError(f"{index}: tensor {_short(name)} is not in its shard {_short(shard)}")
        result[name] = path
    return result


def _is_plain_file_name(name: str) -> bool:
    return (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and Path(name).name == name
    )


def _short(value: object, limit: int = 80) -> str:
    """`repr(value)` cut to about `limit` characters: messages echo a file's text."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _file_of(files: Mapping[str, Path], name: str) -> Path:
    if name not in files:
        where = ", ".join(sorted({str(f) for f in files.values()})) or "no file"
        raise ConfigError(f"{where}: no tensor named {_short(name)}")
    return files[name]


def tensor_shape(files: Mapping[str, Path], name: str) -> tuple[int, ...]:
    """The shape of tensor `name` (of `files`, as `index_directory` gives them), from its
    file's header, reading none of its data."""
    file = _file_of(files, name)
    try:
        return tuple(_open(file).get_slice(name).get_shape())
    except SafetensorError as exc:
        raise ConfigError(f"{file}: tensor {_short(name)}: {exc}") from None


def tensor_table(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the safetensors file `file`: name -> (shape, the file's dtype name, e.g.
    "F32", "BF16"), from its header alone; ConfigError naming the file if the library refuses
    it."""
    handle = _open(file)
    table = {}
    for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
        part = handle.get_slice(name)
        table[name] = (tuple(part.get_shape()), str(part.get_dtype()))
    return table


def load_tensors(
    files: Mapping[str, Path], names: Iterable[str], *, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The tensors `names` (of `files`, as `index_directory` gives them), each read on its own
    onto `device` (default: the CPU) in the dtype its file stores. ConfigError naming the
    tensor (before anything is read) if one is not in `files`, and the file and the tensor
    if the library cannot read it."""
    wanted = list(dict.fromkeys(names))
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(_file_of(files, name), []).append(name)
    device = None if device is None else torch.device(device)
    result: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        handle = _open(file, device)
        for name in file_names:
            try:
                tensor = handle.get_tensor(name)
            except SafetensorError as exc:
                raise ConfigError(f"{file}: tensor {_short(name)}: {exc}") from None
            result[name] = tensor if device is None else tensor.to(device)  # no-op if there
    return {name: result[name] for name in wanted}
