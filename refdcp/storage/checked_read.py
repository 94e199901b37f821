"""Reading an item straight into its destination while checking its CRC-32C (LOAD-10, LOAD-13).

Default load verification must cost little on the hot path. A page-cache read
runs at 8-10 GB/s here and the CRC kernel at 30-50 GB/s on the piece just read,
so checked inline the CRC adds about a quarter of the read's CPU time. With a
CPU free (the load average at least one below the CPUs this process may use), a
large item is checksummed on a helper thread that follows the reads one piece
behind (the read and the CRC kernel both release the GIL), and the check costs
little more than its last piece (LOAD-13). On a busy machine the helper only
adds wake-ups (measured: +33% wall time vs -5..+18% inline, on 2 CPUs at load
average 5-6), so there, and for small items, each piece is checksummed inline
right after its read. Either way one CRC runs over the item's framing bytes and
data, and a mismatch raises after the read.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from queue import SimpleQueue
from typing import Any

from .crc import crc32c
from .errors import CorruptionError
from .items import checksum_of, data_offset_of
from .paths import pread_into

__all__ = ["PIECE_BYTES", "THREAD_MIN_BYTES", "THREAD_PIECE_BYTES", "read_checked_into"]

#: bytes read and checksummed at a time inline: small enough to stay in the L2 cache
PIECE_BYTES = 512 << 10
#: an item this large (and a free CPU) gets its CRC on the helper thread (LOAD-13)
THREAD_MIN_BYTES = 16 << 20
#: bytes read per piece handed to the helper thread
THREAD_PIECE_BYTES = 4 << 20

_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The CRC helper threads of this process: a forked child starts its own (STORE-49)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(2, thread_name_prefix="refdcp-crc-read"))
        return _POOL[1]


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)  # a lock held at the fork stays held


def _idle_cpus() -> float:
    """CPUs this process may use minus the 1-minute load average: about how many are free."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        return cpus - os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average: assume a busy machine
        return 0.0


def _follow(pieces: SimpleQueue[memoryview | None], crc: int) -> int:
    """Continue ``crc`` over each piece put on the queue, until None."""
    while (piece := pieces.get()) is not None:
        crc = crc32c(piece, crc)
    return crc


def _read_small(fd: int, n: int, offset: int, fqn: str, file: str) -> bytearray:
    buf = bytearray(n)
    got = pread_into(fd, memoryview(buf), offset)
    if got != n:
        raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + got)
    return buf


def read_checked_into(fd: int, view: memoryview, info: Any, fqn: str, file: str) -> None:
    """Read an item's data into ``view`` and check the item's CRC-32C (LOAD-10, LOAD-13).

    ``view`` receives the raw data bytes (after refdcp's framing header);
    the CRC covers the whole stored byte range, framing included (INTEG-1).
    Raises :class:`CorruptionError` naming fqn, file and offset on a
    mismatch or a short file; ``view`` may then hold the damaged bytes.
    """
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
    if size >= THREAD_MIN_BYTES and _idle_cpus() >= 1.0:
        crc = _read_followed(fd, view, start, crc, fqn, file)
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


def _read_followed(fd: int, view: memoryview, start: int, crc: int, fqn: str, file: str) -> int:
    """Read ``view`` in pieces while the helper thread checksums each read piece (LOAD-13)."""
    pieces: SimpleQueue[memoryview | None] = SimpleQueue()
    running = _pool().submit(_follow, pieces, crc)
    pos, size = 0, len(view)
    try:
        while pos < size:
            piece = view[pos : pos + THREAD_PIECE_BYTES]
            got = pread_into(fd, piece, start + pos)
            if got != len(piece):
                raise CorruptionError(
                    "data file truncated", fqn=fqn, file=file, offset=start + pos + got
                )
            pieces.put(piece)
            pos += got
    finally:
        pieces.put(None)  # the helper stops; on an error its partial CRC is dropped
        crc = running.result()
    return crc
