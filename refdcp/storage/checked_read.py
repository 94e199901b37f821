"""Reading an item straight into its destination while checking its CRC-32C (LOAD-10).

Default load verification must cost little on the hot path, so the check is
fused with the read: the data is read in pieces small enough to stay in the
CPU cache and each piece is checksummed right after it lands, continuing one
CRC over the item's framing bytes and data. An item of 256 KiB or more is
checksummed on a helper thread, 2 MiB behind the reads (the C code releases
the GIL), and the reader collects the checks before its read completes, so a
free core hides much of the check, across items too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import crc32c

from .errors import CorruptionError
from .items import checksum_of, data_offset_of

__all__ = ["PIECE_BYTES", "read_checked_into"]

#: bytes read and checksummed at a time: small enough to stay in the L2 cache
PIECE_BYTES = 512 << 10
#: an item this large is checksummed on a helper thread, one piece behind the reads
THREAD_MIN_BYTES = 256 << 10
THREAD_PIECE_BYTES = 2 << 20

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """One CRC worker: its tasks run in submission order, so a CRC can be continued."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refdcp-crc")
        return _POOL


class _RunningCrc:
    """A CRC-32C continued piece by piece on the worker thread (the C code releases the GIL)."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.last: Future[None] | None = None

    def _update(self, piece: memoryview) -> None:
        self.value = crc32c.crc32c(piece, self.value, 1)

    def feed(self, piece: memoryview) -> None:
        self.last = _pool().submit(self._update, piece)

    def result(self) -> int:
        if self.last is not None:
            self.last.result()
        return self.value


def _pread(fd: int, view: memoryview, offset: int) -> int:
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def _read_small(fd: int, n: int, offset: int, fqn: str, file: str) -> bytearray:
    buf = bytearray(n)
    got = _pread(fd, memoryview(buf), offset)
    if got != n:
        raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + got)
    return buf


def read_checked_into(
    fd: int, view: memoryview, info: Any, fqn: str, file: str
) -> Callable[[], None]:
    """Read an item's data into ``view``; return the check of the item's CRC-32C (LOAD-10).

    ``view`` receives the raw data bytes (after refdcp's framing header);
    the CRC covers the whole stored byte range, framing included (INTEG-1).
    The CRC of an item of ``THREAD_MIN_BYTES`` or more runs on the helper
    thread while the caller reads on; the returned function waits for it and
    raises :class:`CorruptionError` naming fqn, file and offset on a mismatch
    (a short file raises at once). The caller must call it before reporting
    the read done; ``view`` may then hold the damaged bytes.
    """
    expected = checksum_of(info)
    data_off = data_offset_of(info)
    assert expected is not None and data_off is not None
    base = int(info.offset)
    crc = crc32c.crc32c(_read_small(fd, data_off, base, fqn, file)) if data_off else 0
    start = base + data_off
    pos, size = 0, len(view)
    running = _RunningCrc(crc) if size >= THREAD_MIN_BYTES else None
    step = THREAD_PIECE_BYTES if running is not None else PIECE_BYTES
    while pos < size:
        piece = view[pos : pos + step]
        got = _pread(fd, piece, start + pos)
        if got != len(piece):
            raise CorruptionError(
                "data file truncated", fqn=fqn, file=file, offset=start + pos + got
            )
        if running is not None:
            running.feed(piece)
        else:
            crc = crc32c.crc32c(piece, crc)
        pos += got
    tail_len = int(info.length) - data_off - size
    if tail_len < 0:
        raise CorruptionError(
            f"item framing inconsistent: {size} data bytes do not fit in {info.length}",
            fqn=fqn,
            file=file,
            offset=base,
        )
    tail = _read_small(fd, tail_len, start + size, fqn, file) if tail_len else b""

    def check() -> None:
        value = running.result() if running is not None else crc
        value = crc32c.crc32c(tail, value) if tail else value
        if value != expected:
            raise CorruptionError(
                f"checksum mismatch (stored {expected:08x}, computed {value:08x})",
                fqn=fqn,
                file=file,
                offset=base,
            )

    return check
