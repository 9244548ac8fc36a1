"""The floor under any cross-process evaluation: a raw unix-socket round trip of the same frames.

``python -m evald_lab.bench._raw_floor PATH`` serves the data path's wire format
(:func:`evald.contract.read_frame`) on ``PATH`` with nothing behind it: it accepts any HELLO,
parses each BATCH as an ``EvaluateBatchRequest`` and answers every item with a fixed value in one
``EvaluateBatchResponse``, on one blocking thread per connection. That is the least a process
boundary costs with these messages in Python (two socket hops, two thread wake-ups, protobuf
both ways); the overhead benchmark measures it beside the daemon in the same run, so the
daemon's data path is judged as a multiple of it rather than in absolute microseconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from pathlib import Path

from evald.contract import FrameError, Kind, encode_frame, pb, read_frame

__all__ = ["ANSWER", "main", "serve"]

#: The value every item gets (the short calc input's, so callers can check it alike).
ANSWER = "482"
_MAX_FRAME_BYTES = 64 * 1024 * 1024


def _connection(sock: socket.socket) -> None:
    reader = sock.makefile("rb", buffering=256 * 1024)
    try:
        hello = read_frame(reader.read, 1024)
        if hello is None:
            return
        sock.sendall(encode_frame(Kind.READY, b"raw"))
        while True:
            frame = read_frame(reader.read, _MAX_FRAME_BYTES)
            if frame is None:
                return
            request = pb.EvaluateBatchRequest.FromString(frame[1])
            response = pb.EvaluateBatchResponse(
                results=[pb.EvaluateResponse(id=item.id, value=ANSWER) for item in request.items]
            )
            sock.sendall(encode_frame(Kind.RESULTS, response.SerializeToString()))
    except (OSError, FrameError):
        return
    finally:
        with contextlib.suppress(OSError):
            reader.close()
        sock.close()


def serve(path: Path) -> None:
    """Serves until killed (prints ``ready`` once listening)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(256)
    print("ready", flush=True)
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=_connection, args=(sock,), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m evald_lab.bench._raw_floor SOCKET_PATH", file=sys.stderr)
        return 2
    serve(Path(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
