"""Reading a model directory's weights through the `safetensors` library (models/weight_files.py):
single files and sharded directories, only the tensors asked for, in their stored dtype, and
every failure a ConfigError naming the file and the tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ravnest_node.errors import ConfigError
from ravnest_node.models.weight_files import (
    INDEX_FILE,
    SINGLE_FILE,
    index_directory,
    load_tensors,
    tensor_shape,
)


def _sharded(directory: Path, index: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    first = {"a.weight": torch.randn(4, 3), "a.bias": torch.randn(4)}
    second = {"b.weight": torch.randn(2, 4).to(torch.bfloat16), "b.steps": torch.tensor(3)}
    save_file(first, directory / "model-00001-of-00002.safetensors")
    save_file(second, directory / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {
        n: "model-00002-of-00002.safetensors" for n in second
    }
    content = (
        index if index is not None else {"metadata": {"total_size": 1}, "weight_map": weight_map}
    )
    (directory / INDEX_FILE).write_text(json.dumps(content))
    return first | second


def test_sharded_directory_reads_what_is_asked_in_its_stored_dtype(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path)
    files = index_directory(tmp_path)
    assert set(files) == set(tensors)
    assert files["b.steps"] == tmp_path / "model-00002-of-00002.safetensors"
    loaded = load_tensors(files, ["b.weight", "a.bias"], device=torch.device("cpu"))
    assert list(loaded) == ["b.weight", "a.bias"]
    assert loaded["b.weight"].dtype == torch.bfloat16  # not made float32 on the way
    assert torch.equal(loaded["b.weight"], tensors["b.weight"])
    assert torch.equal(loaded["a.bias"], tensors["a.bias"])
    assert tensor_shape(files, "a.weight") == (4, 3)
    assert load_tensors(files, ["b.steps"], device=torch.device("meta"))["b.steps"].is_meta


def test_single_file_directory_and_a_private_copy(tmp_path: Path) -> None:
    save_file({"w": torch.eye(3)}, tmp_path / SINGLE_FILE)
    files = index_directory(tmp_path)
    w = load_tensors(files, ["w"])["w"]
    assert torch.equal(w, torch.eye(3))
    w.add_(1)  # a parameter trains in place: the file must not change under it
    assert torch.equal(load_tensors(files, ["w"])["w"], torch.eye(3))


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../x.safetensors", "plain"),
        ("sub/x.safetensors", "plain"),
        ("/etc/passwd", "plain"),
        ("..", "plain"),
        ("", "plain"),
        ("a\\b", "plain"),
        (7, "plain"),
        ("absent.safetensors", "missing"),
    ],
)
def test_index_with_a_bad_shard_name(tmp_path: Path, shard: Any, message: str) -> None:
    (tmp_path / "sub").mkdir()
    save_file({"w": torch.ones(1)}, tmp_path / "sub" / "x.safetensors")
    save_file({"w": torch.ones(1)}, tmp_path.parent / "x.safetensors")
    _sharded(tmp_path, {"weight_map": {"w": shard}})
    with pytest.raises(ConfigError, match=message):
        index_directory(tmp_path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1)}, tmp_path / "s.safetensors")
    index = {"weight_map": {"w": "s.safetensors", "v": "s.safetensors"}}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"'v' is not in its shard 's\.safetensors'"):
        index_directory(tmp_path)


@pytest.mark.parametrize("content", ["{", "[]", '{"weight_map": []}', '{"other": {}}', "\xff"])
def test_malformed_index(tmp_path: Path, content: str) -> None:
    (tmp_path / INDEX_FILE).write_bytes(content.encode("latin-1"))
    with pytest.raises(ConfigError, match=INDEX_FILE):
        index_directory(tmp_path)


def test_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither"):
        index_directory(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        index_directory(tmp_path / "absent")


def test_a_missing_tensor_is_named_before_anything_is_read(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / SINGLE_FILE)
    files = index_directory(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.safetensors: no tensor named 'v'"):
        load_tensors(files, ["w", "v"])
    with pytest.raises(ConfigError, match="'v'"):
        tensor_shape(files, "v")


def _raw(path: Path, header: Any, data: bytes = b"", *, header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "header_len"),
    [
        (b"", b"", 1 << 40),  # a header longer than the file
        (b"[1, 2]", b"", None),  # not an object
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), None),  # short
        ({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), None),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), None),
        (b"\xff\xfe", b"", None),  # not UTF-8
    ],
    ids=["header-past-end", "not-object", "data-past-end", "dtype", "size", "not-utf8"],
)
def test_a_file_the_library_refuses_is_a_config_error_naming_it(
    tmp_path: Path, header: Any, data: bytes, header_len: int | None
) -> None:
    _raw(tmp_path / SINGLE_FILE, header, data, header_len=header_len)
    with pytest.raises(ConfigError, match=r"model\.safetensors: not a readable safetensors"):
        index_directory(tmp_path)
