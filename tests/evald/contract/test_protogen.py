"""The committed gRPC stubs are exactly what ``make proto`` (``tools/generate_proto.py``)
generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STUBS = ("evald_pb2.py", "evald_pb2.pyi", "evald_pb2_grpc.py")


def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "generate_proto.py"), str(tmp_path)],
        check=True,
        timeout=120,
    )
    committed = ROOT / "evald" / "v1"
    for name in STUBS:
        fresh = (tmp_path / "evald" / "v1" / name).read_bytes()
        assert fresh == (committed / name).read_bytes(), (
            f"evald/v1/{name} is stale: run `make proto` (python tools/generate_proto.py)"
        )
