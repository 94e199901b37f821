"""CRC-32C of a large buffer, piece by piece, shared by the I/O thread and a helper (INTEG-11, LOAD-14, STORE-51).

Each piece gets its own CRC-32C (from 0), so any thread may compute any piece
in any order; ``crc32c_combine`` joins them (zlib's ``crc32_combine`` for the
Castagnoli polynomial: the CRC of ``a + b`` from the CRCs of ``a`` and ``b``
and the length of ``b``), giving exactly the CRC of the whole buffer (INTEG-9).

``PieceCrc`` hands pieces out: the I/O thread offers each piece right after
reading it (load) or asks for it right before writing it (save); the helper
thread takes the pieces it is allowed to while it keeps up, and the I/O thread
computes the rest itself, on the piece it has just read or is about to write
(cache-resident). On a busy machine the helper simply takes few or no pieces:
no load average is consulted. ``result()`` computes every piece nobody took,
waits for the helper's piece in progress, and returns the whole buffer's CRC.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from refdcp.crc.kernel import crc32c

__all__ = [
    "HELPER_PIECE_BYTES",
    "INLINE_PIECE_BYTES",
    "PieceCrc",
    "crc32c_combine",
    "TwoEnds",
    "crc32c_each",
    "crc32c_pieces",
    "crc32c_shift",
    "helpers_if_cpu_free",
    "idle_cpus",
    "write_checksummed",
]

#: bytes checksummed per piece by the writing thread itself: fit in its L2 cache; written
#: HELPER_PIECE_BYTES at a time (1 MiB writes halved a 4 GiB save's rate on a throttled disk)
INLINE_PIECE_BYTES = 1 << 20
#: bytes written per piece when a helper thread may checksum pieces ahead of the write
HELPER_PIECE_BYTES = 4 << 20

_POLY = 0x82F63B78  # CRC-32C, reflected


def _apply(matrix: tuple[int, ...], vector: int) -> int:
    out = 0
    i = 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(outer: tuple[int, ...], inner: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_apply(outer, column) for column in inner)


def _one_byte() -> tuple[int, ...]:
    bit = (_POLY, *(1 << n for n in range(31)))  # the register after one zero bit
    two = _compose(bit, bit)
    four = _compose(two, two)
    return _compose(four, four)


#: _POWERS[j]: the register's map over 2**j zero bytes
_POWERS: list[tuple[int, ...]] = [_one_byte()]
_BY_LENGTH: dict[int, tuple[int, ...]] = {}
_LOCK = threading.Lock()


def _power(j: int) -> tuple[int, ...]:
    while len(_POWERS) <= j:
        with _LOCK:
            if len(_POWERS) <= j:
                last = _POWERS[-1]
                _POWERS.append(_compose(last, last))
    return _POWERS[j]


def _operator(nbytes: int) -> tuple[int, ...]:
    """The register's map over ``nbytes`` zero bytes (cached, 65 lengths at most: the piece size repeats)."""
    op = _BY_LENGTH.get(nbytes)
    if op is None:
        op = tuple(1 << n for n in range(32))
        j, n = 0, nbytes
        while n:
            if n & 1:
                op = _compose(_power(j), op)
            n >>= 1
            j += 1
        if len(_BY_LENGTH) > 64:
            _BY_LENGTH.clear()
        _BY_LENGTH[nbytes] = op
    return op


def _byte_tables(op: tuple[int, ...]) -> tuple[list[int], ...]:
    """``op`` as four 256-entry tables, one per byte of the register: four look-ups per use."""
    tables = []
    for byte in range(4):
        columns = op[8 * byte : 8 * byte + 8]
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b
            table[b] = table[b ^ low] ^ columns[low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


_TABLES: dict[int, tuple[list[int], ...]] = {}


def _shift_by_tables(crc: int, nbytes: int) -> int:
    """``crc32c_shift`` for a length that repeats (the piece size): table look-ups, cached (9 lengths at most)."""
    tables = _TABLES.get(nbytes)
    if tables is None:
        if len(_TABLES) > 8:
            _TABLES.clear()
        tables = _TABLES[nbytes] = _byte_tables(_operator(nbytes))
    t0, t1, t2, t3 = tables
    return t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]


def crc32c_shift(crc: int, nbytes: int) -> int:
    """``crc`` carried over ``nbytes`` more bytes, as if those bytes were all zero (register only)."""
    return _apply(_operator(nbytes), crc) if nbytes else crc


def _then(crc: int, value: int, n: int, piece: int) -> int:
    """``crc32c_combine(crc, value, n)``, by table look-ups when ``n`` is the repeated ``piece`` size."""
    return (_shift_by_tables(crc, n) if n == piece else crc32c_shift(crc, n)) ^ value


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and ``len2 = len(b)``."""
    return crc32c_shift(crc1, len2) ^ crc2


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """This process's CRC helper threads: a forked child starts its own (STORE-49)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(2, thread_name_prefix="refdcp-crc-piece"))
        return _POOL[1]


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)  # a lock held at the fork stays held


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _running() -> float:
    """Threads running or runnable on the machine now, this one included (``/proc/loadavg``)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return float(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):  # pragma: no cover - not Linux
        try:
            return os.getloadavg()[0] + 1.0
        except OSError:  # no load figure at all: assume a busy machine
            return float("inf")


def idle_cpus() -> float:
    """About how many CPUs this process may use are idle right now (LOAD-14).

    The number of runnable threads at this instant, not the 1-minute load
    average: that one trails by minutes (it still counts a job that ended and
    misses one that just started).
    """
    return _cpus() - _running()


def helpers_if_cpu_free() -> Executor | None:
    """The CRC helper threads when a CPU is idle now, else None: compute inline (LOAD-14, STORE-51)."""
    return _pool() if idle_cpus() >= 1.0 else None


_FREE, _TAKEN, _DONE = 0, 1, 2


class PieceCrc:
    """The CRC-32C of ``view`` continued from ``start``, computed in pieces of ``piece`` bytes.

    ``offer(k)`` (after piece ``k`` is read) and ``claim(k)`` (before piece ``k``
    is written) are called by the one I/O thread in piece order; ``allow(k)``
    lets the helper take pieces before ``k``. Call ``result()`` exactly once,
    also after an error (it waits for the helper, which must not outlive the
    memory it reads).
    """

    def __init__(self, view: memoryview, piece: int, start: int, helpers: Executor | None) -> None:
        self._view = view
        self._piece = piece
        self._start = start
        self._count = -(-len(view) // piece) if len(view) else 0
        self._state = [_FREE] * self._count
        self._crcs = [0] * self._count
        self._allowed = 0  # the helper may take pieces below this
        self._next = 0  # the helper's next candidate piece
        self._closed = False
        self._cond = threading.Condition(threading.Lock())
        self._helper_taken = 0
        if helpers is not None and self._count:
            helpers.submit(self._help)

    @property
    def count(self) -> int:
        """The number of pieces."""
        return self._count

    @property
    def helper_pieces(self) -> int:
        """How many pieces the helper thread computed (for tests and benchmarks)."""
        return self._helper_taken

    def _slice(self, k: int) -> memoryview:
        return self._view[k * self._piece : (k + 1) * self._piece]

    def _help(self) -> None:
        cond, state = self._cond, self._state
        while True:
            with cond:
                while True:
                    while self._next < self._count and state[self._next] != _FREE:
                        self._next += 1
                    if self._closed or self._next >= self._count:
                        return
                    if self._next < self._allowed:
                        break
                    cond.wait()
                k = self._next
                state[k] = _TAKEN
                self._next += 1
                self._helper_taken += 1
            value = crc32c(self._slice(k))
            with cond:
                self._crcs[k] = value
                state[k] = _DONE
                cond.notify_all()

    def allow(self, upto: int) -> None:
        """Let the helper take pieces below ``upto``."""
        with self._cond:
            if upto > self._allowed:
                self._allowed = min(upto, self._count)
                self._cond.notify_all()

    def offer(self, k: int) -> None:
        """Piece ``k`` was just read: the helper takes it when it has taken every piece
        before it (it keeps up), else this thread checksums it now, while it is in cache."""
        with self._cond:
            keeps_up = self._next >= k
            if keeps_up:
                self._allowed = k + 1
                self._cond.notify_all()
                return
            self._state[k] = _TAKEN
        self._compute(k)

    def claim(self, k: int) -> None:
        """Piece ``k`` is about to be written: checksum it now unless the helper took it."""
        with self._cond:
            if self._state[k] != _FREE:
                return
            self._state[k] = _TAKEN
        self._compute(k)

    def _compute(self, k: int) -> None:
        value = crc32c(self._slice(k))
        with self._cond:
            self._crcs[k] = value
            self._state[k] = _DONE

    def close(self) -> None:
        """Stop the helper and wait for its piece in progress (after an error)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while _TAKEN in self._state:
                self._cond.wait()

    def result(self) -> int:
        """Checksum every piece nobody took, wait for the helper, combine (INTEG-9)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            free = [k for k, s in enumerate(self._state) if s == _FREE]
            for k in free:
                self._state[k] = _TAKEN
        for k in free:
            self._compute(k)
        with self._cond:
            while _TAKEN in self._state:
                self._cond.wait()
        crc = self._start
        for k, value in enumerate(self._crcs):
            n = min(self._piece, len(self._view) - k * self._piece)
            crc = _then(crc, value, n, self._piece)
        self._view = memoryview(b"")  # nothing reads the caller's memory after this
        return crc


def write_checksummed(write: Callable[[memoryview], None], data: memoryview, crc: int) -> int:
    """``write`` all of ``data`` in pieces; return the CRC-32C continued from ``crc`` over it (STORE-51).

    Each piece is checksummed just before it is written, so the write copies it
    from cache: by a helper thread one 4 MiB piece ahead of the write when a CPU
    is idle, else by this thread in 1 MiB pieces written 4 MiB at a time (1 MiB
    writes halve the rate once the kernel throttles dirty pages). ``write(view)`` must write all of ``view`` or
    raise; the error then propagates once the helper has let go of ``data``.
    """
    helpers = helpers_if_cpu_free()
    if helpers is None:
        step, group = INLINE_PIECE_BYTES, HELPER_PIECE_BYTES
        for at in range(0, len(data), group):
            chunk = data[at : at + group]
            for b in range(0, len(chunk), step):
                crc = crc32c(chunk[b : b + step], crc)
            write(chunk)
        return crc
    step = HELPER_PIECE_BYTES
    pieces = PieceCrc(data, step, crc, helpers)
    try:
        for k in range(pieces.count):
            pieces.allow(k + 2)  # the helper may work on the next piece while this one is written
            pieces.claim(k)
            write(data[k * step : (k + 1) * step])
    except BaseException:
        pieces.close()
        raise
    return pieces.result()


class TwoEnds:
    """Units of work taken by a helper from the front and by their owner from the back,
    until the ends meet (DEDUP-16, DEDUP-17).

    ``help()`` runs on the helper thread; the owner calls ``finish()`` exactly once
    (also when the helper never started), which computes what is left, waits for
    the unit the helper is on (it must not outlive the memory it reads) and
    re-raises the helper's error; ``stop()`` only lets the helper take nothing more
    and waits for its unit.
    """

    def __init__(self, units: Sequence[Callable[[], None]]) -> None:
        self._units = units
        self._ends = [0, len(units)]  # the helper's next unit; one past the owner's next
        self._busy = 0  # units the helper is computing now (0 or 1)
        self._failed: list[BaseException] = []
        self._cond = threading.Condition(threading.Lock())

    def help(self) -> None:
        cond, ends = self._cond, self._ends
        while True:
            with cond:
                if ends[0] >= ends[1]:
                    return
                j = ends[0]
                ends[0] += 1
                self._busy += 1
            try:
                self._units[j]()
            except BaseException as exc:  # reported by the owner's thread
                self._failed.append(exc)
                with cond:
                    ends[1] = ends[0]
            finally:
                with cond:
                    self._busy -= 1
                    cond.notify_all()

    def finish(self) -> None:
        cond, ends = self._cond, self._ends
        try:
            while True:
                with cond:
                    if ends[0] >= ends[1]:
                        break
                    ends[1] -= 1
                    j = ends[1]
                self._units[j]()
        finally:
            self.stop()
        if self._failed:
            raise self._failed[0]

    def stop(self) -> None:
        with self._cond:
            self._ends[1] = self._ends[0]  # the helper takes nothing more
            while self._busy:
                self._cond.wait()


#: below this many bytes in all, ``crc32c_each`` does not wake a helper thread
EACH_SHARE_MIN_BYTES = 16 << 20


def crc32c_pieces(
    views: Sequence[memoryview], seeds: Sequence[int]
) -> tuple[list[Callable[[], None]], Callable[[], list[int]]]:
    """Units computing each buffer's CRC-32C (continued from its seed) in pieces of at most
    4 MiB, and the function combining the pieces exactly once all have run (INTEG-11)."""
    step = HELPER_PIECE_BYTES
    jobs = [(i, a) for i, v in enumerate(views) for a in range(0, max(len(v), 1), step)]
    crcs = [0] * len(jobs)

    def unit(j: int) -> Callable[[], None]:
        i, a = jobs[j]

        def compute() -> None:
            crcs[j] = crc32c(views[i][a : a + step], seeds[i] if a == 0 else 0)

        return compute

    def combine() -> list[int]:
        out: list[int] = []
        for j, (i, a) in enumerate(jobs):
            if a == 0:
                out.append(crcs[j])
            else:
                out[i] = _then(out[i], crcs[j], min(step, len(views[i]) - a), step)
        return out

    return [unit(j) for j in range(len(jobs))], combine


def crc32c_each(views: Sequence[memoryview], seeds: Sequence[int] | None = None) -> list[int]:
    """The CRC-32C of each buffer (continued from ``seeds[i]``, default 0), shared with a
    helper thread when a CPU is free (DEDUP-16, DEDUP-17).

    The buffers are cut into pieces of at most 4 MiB; the helper takes pieces
    from the front while this thread takes them from the back, until they meet;
    each buffer's CRC is combined exactly from its pieces' (INTEG-11). A helper
    that never starts (its pool busy) costs nothing: this thread then computes
    every piece and waits only for a piece the helper is on.
    """
    start = list(seeds) if seeds is not None else [0] * len(views)
    helpers = helpers_if_cpu_free() if sum(map(len, views)) >= EACH_SHARE_MIN_BYTES else None
    if helpers is None:
        return [crc32c(v, s) for v, s in zip(views, start)]
    units, combine = crc32c_pieces(views, start)
    work = TwoEnds(units)
    helpers.submit(work.help)
    work.finish()
    return combine()


_shift_by_tables(0, HELPER_PIECE_BYTES)  # at import (~2 ms): a fresh process's first load skips it
