"""Types of the native reset loop (``evald/host/_reset.c``)."""

def reset(fd: int, base: int, size: int, offsets: bytes, pages: bytes, page_size: int) -> int:
    """Resets a linear memory to its pristine pages; returns the bytes written."""
