"""Regenerates the evald.v1 stubs from ``proto/`` with grpcio-tools (``make proto``).

One command (``python tools/generate_proto.py [OUT_DIR]``) so the committed stubs are
reproducible and a test can regenerate them into a temporary folder and compare bytes. A
repository tool, not part of the wheel: it reads ``proto/``, which only a checkout has.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
STUBS_ROOT = PROTO_ROOT.parent
PROTO_FILES = ("evald/v1/evald.proto",)


def generate(out_dir: Path) -> None:
    """Writes ``evald/v1/evald_pb2{,_grpc}.py{,i}`` under ``out_dir``.

    Raises:
        RuntimeError: protoc reported an error (its exit status is in the message).
    """
    from grpc_tools import protoc  # dev-only dependency: imported lazily

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / name) for name in PROTO_FILES),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with exit status {status}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUBS_ROOT)
