"""Reading an item straight into its destination while checking its CRC-32C (LOAD-10, LOAD-13, LOAD-14).

Default load verification must cost little on the hot path. A page-cache read
runs at 8-13 GB/s here and the CRC kernel at 30-50 GB/s on the piece just read,
so checked inline the CRC adds about a quarter of the read's CPU time. With a
CPU idle at that instant (the running count, LOAD-14), a large item is read in
4 MiB pieces offered to a helper thread, which checksums each one while the
next is read (the read and the CRC kernel both release the GIL); the reading
thread checksums any piece the helper has not taken, and the pieces' CRCs are
combined exactly (INTEG-11), so a helper that is descheduled costs at most its
piece in progress. On a busy machine a helper only competes for the CPUs
(measured: 0.73 of a raw read vs 0.79 inline, on 2 CPUs with 3-6 threads
running; 0.92 vs 0.81 with one idle), so there, and for small items, each
1 MiB piece is checksummed inline right after its read, while it is in cache.
Either way one CRC covers the item's framing bytes and data, and a mismatch
raises after the read, with the destination zero-filled first (LOAD-20): keeping
the old bytes instead would cost a copy of every destination on every load.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import torch

from refdcp.crc.kernel import crc32c
from refdcp.crc.pieces import PieceCrc, helpers_if_cpu_free
from refdcp.storage.errors import CorruptionError
from refdcp.storage.format.items import checksum_of, data_offset_of
from refdcp.storage.fs.paths import pread_into

__all__ = [
    "PIECE_BYTES",
    "THREAD_MIN_BYTES",
    "THREAD_PIECE_BYTES",
    "read_checked_into",
    "scrub",
]

#: bytes read and checksummed at a time inline: small enough to stay in the L2 cache
PIECE_BYTES = 1 << 20
#: an item this large (and a CPU idle) gets its CRC on a helper thread (LOAD-13, LOAD-14)
THREAD_MIN_BYTES = 16 << 20
#: bytes read per piece offered to the helper thread
THREAD_PIECE_BYTES = 4 << 20


def _helpers() -> Executor | None:
    """The CRC helper threads when a CPU is idle now (LOAD-14), else None."""
    return helpers_if_cpu_free()


def _read_small(fd: int, n: int, offset: int, fqn: str, file: str) -> bytearray:
    buf = bytearray(n)
    got = pread_into(fd, memoryview(buf), offset)
    if got != n:
        raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + got)
    return buf


def scrub(view: memoryview) -> None:
    """Zero-fill ``view``: a destination never keeps bytes that failed their check (LOAD-20)."""
    if len(view):
        torch.frombuffer(view, dtype=torch.uint8).zero_()


def read_checked_into(fd: int, view: memoryview, info: Any, fqn: str, file: str) -> None:
    """Read an item's data into ``view`` and check the item's CRC-32C (LOAD-10, LOAD-13).

    ``view`` receives the raw data bytes (after refdcp's framing header);
    the CRC covers the whole stored byte range, framing included (INTEG-1).
    Raises :class:`CorruptionError` naming fqn, file and offset on a
    mismatch or a short file; ``view`` is then zero-filled, as after any
    failure before the check passed, so it never keeps unchecked bytes (LOAD-20).
    """
    try:
        _read_checked_into(fd, view, info, fqn, file)
    except BaseException:
        scrub(view)
        raise


def _read_checked_into(fd: int, view: memoryview, info: Any, fqn: str, file: str) -> None:
    expected = checksum_of(info)
    data_off = data_offset_of(info)
    assert expected is not None and data_off is not None
    base = int(info.offset)
    size = len(view)
    tail_len = int(info.length) - data_off - size
    if tail_len < 0:
        raise CorruptionError(
            f"item framing inconsistent: {size} data bytes do not fit in {info.length}",
            fqn=fqn,
            file=file,
            offset=base,
        )
    crc = crc32c(_read_small(fd, data_off, base, fqn, file)) if data_off else 0
    start = base + data_off
    helpers = _helpers() if size >= THREAD_MIN_BYTES else None
    if helpers is not None:
        crc = _read_shared(fd, view, start, crc, helpers, fqn, file)
    else:
        pos = 0
        while pos < size:
            piece = view[pos : pos + PIECE_BYTES]
            got = pread_into(fd, piece, start + pos)
            if got != len(piece):
                raise CorruptionError(
                    "data file truncated", fqn=fqn, file=file, offset=start + pos + got
                )
            crc = crc32c(piece, crc)
            pos += got
    if tail_len:
        crc = crc32c(_read_small(fd, tail_len, start + size, fqn, file), crc)
    if crc != expected:
        raise CorruptionError(
            f"checksum mismatch (stored {expected:08x}, computed {crc:08x})",
            fqn=fqn,
            file=file,
            offset=base,
        )


def _read_shared(
    fd: int, view: memoryview, start: int, crc: int, helpers: Executor, fqn: str, file: str
) -> int:
    """Read ``view`` in pieces, each checksummed by the helper thread while it keeps up,
    else right after its read by this thread (LOAD-14); the CRC continued from ``crc``."""
    pieces = PieceCrc(view, THREAD_PIECE_BYTES, crc, helpers)
    pos, size, k = 0, len(view), 0
    try:
        while pos < size:
            piece = view[pos : pos + THREAD_PIECE_BYTES]
            got = pread_into(fd, piece, start + pos)
            if got != len(piece):
                raise CorruptionError(
                    "data file truncated", fqn=fqn, file=file, offset=start + pos + got
                )
            pieces.offer(k)
            pos += got
            k += 1
    except BaseException:
        pieces.close()  # the helper stops before the caller's memory may go away
        raise
    return pieces.result()
