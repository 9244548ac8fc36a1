"""Putting a wasm linear memory back to its initial contents: what lets ``isolation = "fresh"``
keep an instance instead of making one per call.

Why apart from :mod:`evald.host._fastcall`: this is the kernel side of the fresh path (the
``PAGEMAP_SCAN`` ioctl on ``/proc/self/pagemap``, its probe, the C loop in
``evald/host/_reset.c``), with a contract of its own (:class:`MemoryReset`); it needs of a memory
only its base, size and a view (:class:`Memory`, which ``_fastcall.RawMemory`` is).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final, Protocol

__all__ = [
    "HOST_PAGE_BYTES",
    "RESIDENT_GROWTH_BYTES",
    "Memory",
    "MemoryReset",
    "memory_reset_unavailable",
    "pristine_pages",
]


class Memory(Protocol):
    """A linear memory as a reset reads it (:class:`evald.host._fastcall.RawMemory`)."""

    def base(self) -> int: ...

    def size(self) -> int: ...

    def view(self) -> memoryview: ...


#: The host's page: the unit the kernel reports written memory in.
HOST_PAGE_BYTES: Final = mmap.PAGESIZE
#: How much of what calls grew a memory by stays resident between calls (zeroed in place, like
#: the image's pages); the rest is given back to the kernel at each reset. A page kept resident
#: costs a page write at every reset once written, even by calls that no longer touch it; one
#: given back costs a page fault to the next call that does.
RESIDENT_GROWTH_BYTES: Final = 2**20


class _PageRegion(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("categories", ctypes.c_uint64),
    ]


class _ScanArguments(ctypes.Structure):
    """``struct pm_scan_arg`` (linux/fs.h, Linux 6.7)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


# _IOWR('f', 16, struct pm_scan_arg)
_PAGEMAP_SCAN: Final = (3 << 30) | (ctypes.sizeof(_ScanArguments) << 16) | (ord("f") << 8) | 16
_PAGE_IS_FILE: Final = 1 << 2
_PAGE_IS_PRESENT: Final = 1 << 3
_PAGE_IS_SWAPPED: Final = 1 << 4
_PAGE_IS_PFNZERO: Final = 1 << 5
_REGIONS: Final = 32

_LIBC_RELEASED = ctypes.CDLL(None, use_errno=True)
_ioctl = _LIBC_RELEASED.ioctl  # a syscall of microseconds: the GIL is released for it
_ioctl.restype = ctypes.c_int
_madvise = _LIBC_RELEASED.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_MADV_DONTNEED: Final = 4
_PAGE_ZEROS: Final = bytes(HOST_PAGE_BYTES)
_zero_bytes = memoryview(bytes(16 * HOST_PAGE_BYTES))


def _zeros(length: int) -> memoryview:
    """``length`` zero bytes to copy from (grown, never shrunk, when a region is longer)."""
    global _zero_bytes
    if len(_zero_bytes) < length:
        _zero_bytes = memoryview(bytes(length))
    return _zero_bytes[:length]


class _Pagemap:
    """This process's ``/proc/self/pagemap``, opened again in a forked child (a child that kept
    the parent's would read the parent's page tables)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fd = ctypes.c_int(-1)
        self.error = ""
        self._probed = False
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        # the child's first thread: the lock may have been held by another thread at the fork
        self._lock = threading.Lock()
        if self.fd.value >= 0:
            os.close(self.fd.value)
            self.fd = ctypes.c_int(-1)
            self._probed = False
            self.unavailable()  # the child's own pagemap, before anything resets a memory

    def unavailable(self) -> str:
        """Why the scan cannot be used here (``""`` when it can); probed once per process."""
        with self._lock:
            if not self._probed:
                self._probed = True
                self.error = self._probe()
            return self.error

    def _probe(self) -> str:
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return f"/proc/self/pagemap cannot be opened ({exc.strerror})"
        probe = bytearray(HOST_PAGE_BYTES * 2)
        base = ctypes.addressof((ctypes.c_char * len(probe)).from_buffer(probe))
        start = -(-base // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
        regions = (_PageRegion * 1)()
        arguments = _ScanArguments(
            size=ctypes.sizeof(_ScanArguments),
            start=start,
            end=start + HOST_PAGE_BYTES,
            vec=ctypes.addressof(regions),
            vec_len=1,
            category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
            return_mask=_PAGE_IS_PRESENT,
        )
        if _ioctl(ctypes.c_int(fd), ctypes.c_ulong(_PAGEMAP_SCAN), ctypes.byref(arguments)) < 0:
            errno = ctypes.get_errno()
            os.close(fd)
            return f"the kernel has no PAGEMAP_SCAN ({os.strerror(errno)}; Linux 6.7 or later)"
        self.fd = ctypes.c_int(fd)
        return ""


_PAGEMAP = _Pagemap()

try:  # the same loop in C (evald/host/_reset.c), where it was built
    from evald.host import _reset as _native_reset

    _NATIVE_RESET: Any = _native_reset
except ImportError:
    _NATIVE_RESET = None


def memory_reset_unavailable() -> str:
    """Why :class:`MemoryReset` cannot work in this process (``""`` when it can)."""
    return _PAGEMAP.unavailable()


def pristine_pages(memory: Memory) -> tuple[tuple[int, bytes], ...]:
    """The non-zero host pages of ``memory`` as (offset, bytes), read before any guest call.

    Reading maps each page (the kernel's zero page, or the module image's file page): this is
    for a probe instance at load, which is dropped afterwards.
    """
    view = memory.view()
    size, page = len(view), HOST_PAGE_BYTES
    found = []
    for offset in range(0, size - size % page, page):
        chunk = bytes(view[offset : offset + page])
        if chunk != _PAGE_ZEROS:
            found.append((offset, chunk))
    return tuple(found)


class MemoryReset:
    """Puts one linear memory back to its initial contents, keeping its pages resident.

    Contract (a wrong answer here is one caller's data reaching the next, not an exception):

    * ``base`` and ``size`` are the memory's base address and size *now*: the caller checks
      after every call whether the size changed and then calls :meth:`follow` (which refuses a
      memory that moved: its instance is dropped). The reset is created from a memory made by
      wasmtime, a private mapping of anonymous memory and of the module's image.
    * ``pristine`` holds every non-zero host page of that memory as a new instance has it
      (:func:`pristine_pages` of a probe instance of the same compiled module, which has no
      start function), sorted by offset; every other page of a new instance is zero, and so is
      every page a ``memory.grow`` adds. A memory that grew is reset over its whole size: the
      pages above the image end as zeros, as a grow of a new instance finds them (the guest
      sees the image's size again through :mod:`evald.host._instrument`'s guest size). Past
      :data:`RESIDENT_GROWTH_BYTES` above the image they are given back to the kernel first
      (``madvise(MADV_DONTNEED)``: they read as zeros again); the scan then covers them too,
      so a page that call could not give back is zeroed like any other.
    * One thread at a time, and never while a guest call runs on the memory.

    Why every page ends as a new instance has it: the kernel's ``PAGEMAP_SCAN`` reports each
    page of the range that is present or swapped out and neither a file page nor the shared
    zero page. Any other page is one the guest never wrote since it was last reset: not
    present (it reads as the image or as zeros when touched), a file page (the image, mapped
    privately and never written: a write makes an anonymous copy), or the zero page. Each
    reported page is set to zero, then the pristine pages among the reported ones are copied
    back. Pages that read as the zero page are left alone, except pristine pages, which are
    copied back there too (a non-zero page cannot have become the zero page unless its
    contents became zero, but writing it back costs nothing and needs no such argument).
    Reset pages stay resident (but those given back above the image): the next call writes
    them without a page fault. The scan is
    repeated from where it stopped until it has covered the whole range. The loop runs in C
    (``evald/host/_reset.c``, without the GIL) where that extension was built, else here.

    Raises (from :meth:`reset`):
        OSError: the scan failed; the memory may not be reset, so the caller must drop it.
    """

    __slots__ = (
        "_arguments",
        "_arguments_ref",
        "_fields",
        "_native",
        "_native_offsets",
        "_native_pages",
        "_offsets",
        "_pristine",
        "_regions",
        "_request",
        "_view",
        "_words",
        "base",
        "release_from",
        "size",
    )

    def __init__(
        self, memory: Memory, pristine: Sequence[tuple[int, bytes]], *, native: bool = True
    ) -> None:
        reason = memory_reset_unavailable()
        if reason:
            raise OSError(reason)
        base, size = memory.base(), memory.size()
        if base % HOST_PAGE_BYTES or size % HOST_PAGE_BYTES:
            raise ValueError("the memory is not aligned to host pages")
        self.base = base
        self.size = size
        #: Where the pages given back at each reset begin (offset; none below the memory's end).
        self.release_from = size + RESIDENT_GROWTH_BYTES
        #: Writes go through a view of the memory: a copy without a foreign call.
        self._view = memory.view()
        self._pristine = tuple(pristine)
        self._offsets = [offset for offset, _ in self._pristine]
        if self._offsets != sorted(self._offsets) or any(
            offset % HOST_PAGE_BYTES or offset + len(data) > size for offset, data in pristine
        ):
            raise ValueError("pristine pages must be sorted, aligned and inside the memory")
        self._regions = (_PageRegion * _REGIONS)()
        #: The regions as flat u64 words (start, end, categories): read without ctypes fields.
        self._words = memoryview(self._regions).cast("B").cast("Q")
        self._arguments = _ScanArguments(
            size=ctypes.sizeof(_ScanArguments),
            vec=ctypes.addressof(self._regions),
            vec_len=_REGIONS,
            # present or swapped out, and neither a file page
            category_inverted=_PAGE_IS_FILE,
            category_mask=_PAGE_IS_FILE,
            category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
            # regions split where the zero page begins or ends
            return_mask=_PAGE_IS_PFNZERO,
        )
        self._fields = memoryview(self._arguments).cast("B").cast("Q")  # [2] start, [4] walk_end
        self._arguments_ref = ctypes.byref(self._arguments)
        self._request = ctypes.c_ulong(_PAGEMAP_SCAN)
        #: The loop in C where it was built (``native=False`` forces the Python one, for tests).
        self._native = _NATIVE_RESET if native else None
        self._native_offsets = b"".join(o.to_bytes(8, sys.byteorder) for o in self._offsets)
        self._native_pages = b"".join(data for _, data in self._pristine)
        if any(len(data) != HOST_PAGE_BYTES for _, data in self._pristine):
            raise ValueError("pristine pages must be whole host pages")

    def follow(self, memory: Memory) -> bool:
        """Extends the reset to ``memory``'s size after a call grew it (the same memory).

        Returns False, changing nothing, when the memory moved or is not whole host pages: the
        caller must then drop the instance (wasmtime's memories here are reserved in place and
        never move, but the reset writes at ``base``, so it checks rather than assumes).
        """
        base, size = memory.base(), memory.size()
        if base != self.base or size < self.size or size % HOST_PAGE_BYTES:
            return False
        self.size = size
        self._view = memory.view()
        return True

    def reset(self) -> int:
        """Resets the memory (see the class contract); returns the bytes it wrote."""
        release_from = self.release_from
        if self.size > release_from:
            # not checked: the scan below zeroes any page this leaves in place
            _madvise(self.base + release_from, self.size - release_from, _MADV_DONTNEED)
        native = self._native
        if native is not None:
            written: int = native.reset(
                _PAGEMAP.fd.value,
                self.base,
                self.size,
                self._native_offsets,
                self._native_pages,
                HOST_PAGE_BYTES,
            )
            return written
        fields = self._fields
        words = self._words
        view = self._view
        offsets = self._offsets
        base = self.base
        end = base + self.size
        fields[2] = base
        fields[3] = end
        written = 0
        while True:
            count = _ioctl(_PAGEMAP.fd, self._request, self._arguments_ref)
            if count < 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"PAGEMAP_SCAN failed: {os.strerror(errno)}")
            zeros = _zero_bytes
            for index in range(0, 3 * count, 3):
                start = words[index] - base
                stop = words[index + 1] - base
                if not words[index + 2] & _PAGE_IS_PFNZERO:
                    length = stop - start
                    view[start:stop] = zeros[:length] if length <= len(zeros) else _zeros(length)
                    written += length
                if offsets and offsets[-1] >= start:
                    written += self._restore(start, stop)
            walked = fields[4]
            if walked >= end:
                return written
            if count == 0 and walked <= fields[2]:
                raise OSError("PAGEMAP_SCAN stopped before the end of the memory")
            fields[2] = walked

    def _restore(self, start: int, end: int) -> int:
        """Copies the pristine pages inside [start, end) (offsets) back; returns the bytes."""
        offsets = self._offsets
        index = bisect.bisect_left(offsets, start)
        written = 0
        view = self._view
        while index < len(offsets) and offsets[index] < end:
            offset, data = self._pristine[index]
            view[offset : offset + len(data)] = data
            written += len(data)
            index += 1
        return written
