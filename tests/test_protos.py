"""The committed generated code is exactly what `make protos` produces from protos/."""

from __future__ import annotations

from pathlib import Path

from .conftest import require_module

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["control_pb2.py", "control_pb2.pyi", "control_pb2_grpc.py"]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    protoc = require_module("grpc_tools.protoc")
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
        str(ROOT / "protos/ravnest_node/proto/control.proto"),
    ])  # fmt: skip
    assert rc == 0
    for name in GENERATED:
        fresh = (tmp_path / "ravnest_node/proto" / name).read_text()
        committed = (ROOT / "ravnest_node/proto" / name).read_text()
        assert fresh == committed, f"ravnest_node/proto/{name} is stale: run `make protos`"
