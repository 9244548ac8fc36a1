"""The committed gRPC stubs are exactly what `python -m evald._protogen` generates."""

from __future__ import annotations

from pathlib import Path

from evald import _protogen

STUBS = ("evald_pb2.py", "evald_pb2.pyi", "evald_pb2_grpc.py")


def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    _protogen.generate(tmp_path)
    committed = _protogen.PROTO_ROOT.parent / "evald" / "v1"
    for name in STUBS:
        fresh = (tmp_path / "evald" / "v1" / name).read_bytes()
        assert fresh == (committed / name).read_bytes(), (
            f"evald/v1/{name} is stale: run `python -m evald._protogen` (or `make proto`)"
        )
