"""Reading and writing the safetensors format, so a node can load a pretrained model's weights.

A safetensors file is an 8-byte little-endian unsigned length N, then N bytes of UTF-8 JSON, then
the data section. The JSON object maps each tensor name to ``{"dtype": "F32", "shape": [..],
"data_offsets": [begin, end]}`` (offsets relative to the start of the data section, raw
little-endian row-major bytes) and may hold ``"__metadata__"``, a map of strings to strings.
A Hugging Face model directory holds either ``model.safetensors`` or
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file name}}``) beside
its shard files.

Files come from elsewhere (a download, a copy from a peer), so `read_header` checks every field
before anything is allocated: a malformed file raises `SafetensorsError` naming the file and the
tensor, never a huge allocation or an unrelated exception. `load_tensors` then reads only the
bytes of the tensors asked for, so a stage loads its own blocks out of a model of any size.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ravnest_node.errors import ConfigError

__all__ = [
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "SINGLE_FILE",
    "SafetensorsError",
    "TensorEntry",
    "index_directory",
    "load_tensors",
    "read_header",
    "save_tensors",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest JSON header (and index file) accepted, in bytes: more is taken as a hostile file."""

SINGLE_FILE = "model.safetensors"
"""The file name of an unsharded model in a Hugging Face model directory."""

INDEX_FILE = "model.safetensors.index.json"
"""The file name of a sharded model's index in a Hugging Face model directory."""

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_METADATA = "__metadata__"


class SafetensorsError(ConfigError):
    """A safetensors file, or a model directory's index, is malformed or lacks a tensor."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype and shape, and its bytes ``[begin, end)`` as
    absolute offsets in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def size_bytes(self) -> int:
        """Length of the tensor's data in bytes."""
        return self.end - self.begin


def _short(value: object, limit: int = 80) -> str:
    """`repr(value)` cut to about `limit` characters: messages echo hostile input."""
    text = repr(value) if not isinstance(value, list) or len(value) < limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse_json(raw: bytes, what: str) -> Any:
    """`raw` as JSON, or SafetensorsError naming `what`. Duplicate keys are an error: a reader
    that kept the first and one that kept the last would see different tensors."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"{what} is not UTF-8: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise SafetensorsError(f"{what} is not valid JSON: {exc}") from exc


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of the safetensors file `path` (name -> where it lies) and its metadata.

    Reads the header only. Raises `SafetensorsError`, naming the file and the tensor, if the
    header is longer than `MAX_HEADER_BYTES` or than the file, is not a JSON object, names an
    unknown dtype, has a shape that is not a list of non-negative ints, has offsets whose length
    does not match the shape and dtype or that lie outside the file, has two tensors whose bytes
    overlap, or has metadata that is not a map of strings to strings; `OSError` if the file
    cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_HEADER_BYTES:
            raise SafetensorsError(
                f"{path}: header of {header_len} bytes is over the limit of {MAX_HEADER_BYTES}"
            )
        if header_len > size - 8:
            raise SafetensorsError(
                f"{path}: header of {header_len} bytes is longer than the file ({size} bytes)"
            )
        raw = f.read(header_len)
    if len(raw) < header_len:
        raise SafetensorsError(f"{path}: the file ended inside its header (it changed?)")
    header = _parse_json(raw, f"{path}: header")
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + header_len
    data_len = size - data_start
    metadata = _metadata(path, header.pop(_METADATA, {}))
    entries = {
        name: _entry(path, name, info, data_start, data_len) for name, info in header.items()
    }
    _check_disjoint(path, entries)
    return entries, metadata


def _metadata(path: Path, value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise SafetensorsError(f"{path}: {_METADATA} is not a JSON object")
    for key, item in value.items():
        if not isinstance(item, str):
            raise SafetensorsError(f"{path}: {_METADATA}[{_short(key)}] is not a string")
    return dict(value)


def _entry(path: Path, name: str, info: object, data_start: int, data_len: int) -> TensorEntry:
    where = f"{path}: tensor {_short(name)}"
    if not isinstance(info, dict):
        raise SafetensorsError(f"{where}: is not a JSON object")
    if set(info) != _ENTRY_KEYS:
        raise SafetensorsError(
            f"{where}: has keys {_short(sorted(info))}, expected exactly {sorted(_ENTRY_KEYS)}"
        )
    dtype_name = info["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise SafetensorsError(
            f"{where}: unknown dtype {_short(dtype_name)}; known are {', '.join(_DTYPES)}"
        )
    dtype = _DTYPES[dtype_name]
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: shape {_short(shape)} is not a list of non-negative ints")
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise SafetensorsError(f"{where}: data_offsets {_short(offsets)} is not a list of two ints")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise SafetensorsError(f"{where}: data_offsets [{begin}, {end}] is not a range")
    expected = _size_bytes(shape, dtype.itemsize, limit=end - begin)
    if end - begin != expected:
        raise SafetensorsError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape "
            f"{_short(shape)} of {dtype_name} needs "
            + (str(expected) if expected is not None else "more")
        )
    if end > data_len:
        raise SafetensorsError(
            f"{where}: data_offsets [{begin}, {end}] go past the end of the data section "
            f"({data_len} bytes)"
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _size_bytes(shape: list[int], itemsize: int, *, limit: int) -> int | None:
    """Bytes a tensor of `shape` takes, or None once it is clear that they are more than
    `limit` (a hostile shape of a thousand huge dimensions costs no bignum arithmetic)."""
    if 0 in shape:
        return 0
    size = itemsize
    for i, dim in enumerate(shape):
        size *= dim
        if size > limit and i + 1 < len(shape):
            return None
    return size


def _check_disjoint(path: Path, entries: Mapping[str, TensorEntry]) -> None:
    # Empty tensors own no bytes, so they cannot overlap anything.
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end, before), (begin, _, after) in itertools.pairwise(spans):
        if begin < end:
            raise SafetensorsError(f"{path}: tensors {_short(before)} and {_short(after)} overlap")


def index_directory(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the Hugging Face model directory `directory` (name -> where it lies).

    Reads `SINGLE_FILE` if it is there, else `INDEX_FILE` and the headers of the shards it
    names. Raises `SafetensorsError` if neither is there, if the index is malformed, names a
    shard that is not a plain file name inside the directory (no ``..``, no path separators),
    or names a tensor its shard lacks, or if a file is malformed (see `read_header`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SafetensorsError(f"{directory} is not a directory")
    single = directory / SINGLE_FILE
    if single.is_file():
        return read_header(single)[0]
    index = directory / INDEX_FILE
    if not index.is_file():
        raise SafetensorsError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    return _read_index(index)


def _read_index(index: Path) -> dict[str, TensorEntry]:
    with open(index, "rb") as f:
        raw = f.read(MAX_HEADER_BYTES + 1)
    if len(raw) > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{index}: over the limit of {MAX_HEADER_BYTES} bytes")
    content = _parse_json(raw, str(index))
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f'{index}: has no "weight_map" object')
    shards: dict[str, dict[str, TensorEntry]] = {}
    result = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _is_plain_file_name(shard):
            raise SafetensorsError(
                f"{index}: tensor {_short(name)} is in {_short(shard)}, which is not a plain "
                "file name inside the model directory"
            )
        if shard not in shards:
            path = index.parent / shard
            if not path.is_file():
                raise SafetensorsError(
                    f"{index}: shard {_short(shard)} of tensor {_short(name)} is missing"
                )
            shards[shard] = read_header(path)[0]
        if name not in shards[shard]:
            raise SafetensorsError(
                f"{index}: tensor {_short(name)} is not in its shard {_short(shard)}"
            )
        result[name] = shards[shard][name]
    return result


def _is_plain_file_name(name: str) -> bool:
    return (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and Path(name).name == name
    )


def _check_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every platform we run on is
        raise RuntimeError("safetensors data is little-endian; this host is big-endian")


def load_tensors(
    entries: Mapping[str, TensorEntry], names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The tensors `names` (from `entries`, as `read_header` or `index_directory` give them).

    Reads only those tensors' bytes, each straight into a tensor of its own (no memory map, no
    read of a whole file), so the result can be kept, changed and moved freely. Raises
    `SafetensorsError` naming a name that is not in `entries` (before reading anything) or a
    file that has become shorter than its header says; `OSError` if a file cannot be read.
    """
    _check_little_endian()
    wanted = list(dict.fromkeys(names))
    for name in wanted:
        if name not in entries:
            raise SafetensorsError(f"no tensor named {name!r} among the {len(entries)} given")
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(entries[name].file, []).append(name)
    result: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        with open(file, "rb", buffering=0) as f:
            for name in sorted(file_names, key=lambda n: entries[n].begin):
                result[name] = _read_tensor(f, name, entries[name])
    return {name: result[name] for name in wanted}


def _read_tensor(f: Any, name: str, entry: TensorEntry) -> torch.Tensor:
    flat = torch.empty(math.prod(entry.shape), dtype=entry.dtype)
    if entry.size_bytes:
        view = flat.view(torch.uint8).numpy().data
        f.seek(entry.begin)
        filled = 0
        while filled < entry.size_bytes:
            count = f.readinto(view[filled:])
            if not count:
                raise SafetensorsError(
                    f"{entry.file}: tensor {name!r}: the file ended at byte "
                    f"{entry.begin + filled} of {entry.end} (it changed after its header was read?)"
                )
            filled += count
    return flat.reshape(entry.shape)


def save_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (and `metadata`, strings to strings) to the safetensors file `path`.

    Atomic: the file is written beside `path` under a temporary name, flushed to disk and then
    renamed over `path`, so a reader sees the old file or the whole new one. Tensors are laid
    out contiguously in sorted-name order after a header padded with spaces to a multiple of
    8 bytes. Raises `SafetensorsError` for a dtype the format lacks, a name ``__metadata__`` or
    metadata that is not strings; `OSError` if the file cannot be written.
    """
    _check_little_endian()
    path = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise SafetensorsError(f"metadata {key!r}: {value!r} is not a string to a string")
        header[_METADATA] = dict(metadata)
    names = sorted(tensors)
    offset = 0
    for name in names:
        tensor = tensors[name]
        if name == _METADATA:
            raise SafetensorsError(f"a tensor may not be named {_METADATA!r}")
        if tensor.dtype not in _NAMES:
            raise SafetensorsError(
                f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name; "
                f"supported are {', '.join(map(str, _NAMES))}"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little"))
            f.write(encoded)
            for name in names:
                f.write(_tensor_bytes(tensors[name]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; not every platform lets a directory be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
