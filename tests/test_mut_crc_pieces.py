"""crc/pieces.py under direct control (issue 28's crc survivors): the piece sizes STORE-51 and
STORE-55 name, the order of checksum and write, how far ahead the helper may go on a save and
on a load, the helper letting go of the memory after an error, the two-ended scheduler of
DEDUP-16, the bounded operator and table caches, the CPU and running-thread counts LOAD-14
decides from (with their non-Linux fallbacks), and the per-process pool of STORE-49.

Every helper here runs on a thread the test starts or on an executor it controls, so the
lines under test run whatever the machine's load (``helpers_if_cpu_free`` is not consulted).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import crc32c as crc32c_package
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refdcp.crc.pieces as crc_pieces
from refdcp.crc.kernel import crc32c
from refdcp.crc.pieces import PieceCrc, TwoEnds

MiB = 1 << 20
#: how long a test waits for another thread before it fails (never reached on the real code)
PATIENCE = 10.0


def _crc(data: Any, value: int = 0) -> int:
    return int(crc32c_package.crc32c(bytes(data), value))


def _until(condition: Callable[[], bool], patience: float = PATIENCE) -> bool:
    deadline = time.monotonic() + patience
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


class _Capturing(ThreadPoolExecutor):
    """A pool of its own that keeps the futures of what it was given."""

    def __init__(self, workers: int = 1) -> None:
        super().__init__(workers)
        self.futures: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut = super().submit(fn, *args, **kwargs)
        self.futures.append(fut)
        return fut


@pytest.fixture
def pool() -> Iterator[_Capturing]:
    executor = _Capturing()
    try:
        yield executor
    finally:
        executor.shutdown(wait=True)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PieceCrc]]:
    """Every PieceCrc the code under test makes; each is closed at teardown, so a helper left
    waiting (on a mutant) cannot keep the test's pool from shutting down."""
    out: list[PieceCrc] = []
    real = crc_pieces.PieceCrc

    class Recorded(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            out.append(self)

    monkeypatch.setattr(crc_pieces, "PieceCrc", Recorded)
    yield out
    for pieces in out:
        pieces.close()


class _NeverRuns(ThreadPoolExecutor):
    """Every worker busy for good: what is submitted never starts."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return Future()


# -- the piece sizes of a checksummed write (STORE-51, STORE-55) -------------------------------


@pytest.mark.spec("STORE-51", "STORE-55")
@pytest.mark.parametrize("helper", ["inline", "never"])
def test_a_write_is_checksummed_in_the_named_piece_sizes_each_just_before_it_is_written(
    monkeypatch: pytest.MonkeyPatch, helper: str
) -> None:
    # Inline: 1 MiB checksummed pieces written 4 MiB at a time; with a helper (here one that
    # never starts, so the writing thread computes each piece itself): 4 MiB pieces. Either
    # way a piece is checksummed before it is written, never after (the write reads it from
    # cache), and the spec's sizes are literal: 1 MiB and 4 MiB.
    monkeypatch.setattr(
        crc_pieces, "helpers_if_cpu_free", lambda: None if helper == "inline" else _NeverRuns()
    )
    events: list[tuple[str, int]] = []  # (what, length), in order
    data = memoryview(os.urandom(2 * (4 * MiB) + MiB + 5))

    def recorded(piece: Any, value: int = 0) -> int:
        events.append(("crc", len(piece)))
        return crc32c(piece, value)

    monkeypatch.setattr(crc_pieces, "crc32c", recorded)
    got = crc_pieces.write_checksummed(lambda v: events.append(("write", len(v))), data, 11)
    assert got == _crc(data, 11)
    writes = [n for what, n in events if what == "write"]
    crcs = [n for what, n in events if what == "crc"]
    assert writes == [4 * MiB, 4 * MiB, MiB + 5]
    step = MiB if helper == "inline" else 4 * MiB
    assert crcs[:-1] == [step] * (len(crcs) - 1)
    assert sum(crcs) == len(data) and 0 < crcs[-1] <= step
    # every byte is checksummed before the write that covers it (the kernel's calls and the
    # writes both go through the buffer in order)
    checksummed = written = 0
    for what, n in events:
        if what == "crc":
            checksummed += n
        else:
            written += n
            assert checksummed >= written, (checksummed, written)


# -- how far ahead the helper may go (STORE-55 on a save, LOAD-15 on a load) -----------------


@pytest.mark.spec("STORE-51", "STORE-55")
def test_while_a_piece_is_written_the_helper_takes_the_next_one_and_no_further(
    monkeypatch: pytest.MonkeyPatch, pool: _Capturing, made: list[PieceCrc]
) -> None:
    # Small pieces (the sizes are the previous test's subject); the write of piece k waits
    # until the helper has checksummed piece k + 1, then gives it time to go further: it must
    # not (at most one piece ahead of the write).
    piece = 4096
    monkeypatch.setattr(crc_pieces, "HELPER_PIECE_BYTES", piece)
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: pool)
    data = memoryview(os.urandom(6 * piece + 100))
    seen: list[tuple[int, bool, bool]] = []  # (piece written, next one done, one after free)

    def write(view: memoryview) -> None:
        k = len(seen)
        state = made[0]._state
        if k + 1 < len(state):
            so_far = all(a for _k, a, _b in seen)  # wait once only when the helper falls behind
            ahead = so_far and _until(lambda: state[k + 1] == crc_pieces._DONE)
            time.sleep(0.02)  # room for a helper allowed further to take the piece after
            beyond = k + 2 >= len(state) or state[k + 2] == crc_pieces._FREE
            seen.append((k, ahead, beyond))
        else:
            seen.append((k, True, True))

    got = crc_pieces.write_checksummed(write, data, 5)
    assert got == _crc(data, 5)
    assert [k for k, _a, _b in seen] == list(range(7))
    assert all(ahead for _k, ahead, _b in seen), seen  # the helper worked one piece ahead
    assert all(beyond for _k, _a, beyond in seen), seen  # and never two
    assert made[0].helper_pieces == 6  # every piece but the first


@pytest.mark.spec("LOAD-14", "INTEG-11", "LOAD-15")
@settings(max_examples=5, deadline=None)
@given(count=st.integers(2, 24), tail=st.integers(0, 4095), start=st.integers(0, 2**32 - 1))
def test_on_a_load_the_helper_never_takes_a_piece_before_it_is_read(
    count: int, tail: int, start: int
) -> None:
    # The buffer fills piece by piece as a read would; each piece is offered once it is in.
    # The helper keeps up (the reader waits for it), so it takes every piece, and none early:
    # a piece checksummed before its read would give the CRC of the bytes that were there.
    piece = 4096
    final = os.urandom((count - 1) * piece + (tail or piece))
    buffer = bytearray(len(final))
    early: list[int] = []
    with _Capturing() as pool:
        pieces = PieceCrc(memoryview(buffer), piece, start, pool)
        for k in range(pieces.count):
            buffer[k * piece : (k + 1) * piece] = final[k * piece : (k + 1) * piece]
            pieces.offer(k)
            assert _until(lambda k=k: pieces._state[k] == crc_pieces._DONE)
            time.sleep(0.001)  # room for a helper allowed further to take the next piece
            if k + 1 < pieces.count and pieces._state[k + 1] != crc_pieces._FREE:
                early.append(k + 1)
        assert pieces.result() == _crc(final, start)
        assert early == []
        assert pieces.helper_pieces == pieces.count


@pytest.mark.spec("LOAD-14", "STORE-51", "LOAD-15")
@pytest.mark.parametrize("mode", ["offer", "allow"])
def test_a_helper_with_nothing_left_to_take_gives_its_thread_back_before_the_result(
    pool: _Capturing, mode: str
) -> None:
    # The pool's threads are shared by every item: a helper that has taken every piece returns
    # at once instead of waiting for result().
    data = os.urandom(5 * 4096 + 7)
    pieces = PieceCrc(memoryview(data), 4096, 3, pool)
    try:
        for k in range(pieces.count):
            if mode == "offer":
                pieces.offer(k)
                assert _until(lambda k=k: pieces._state[k] == crc_pieces._DONE)
            else:
                pieces.allow(k + 1)
        done, _ = wait(pool.futures, timeout=PATIENCE)
        assert len(done) == 1 and pieces.helper_pieces == pieces.count
    finally:
        assert pieces.result() == _crc(data, 3)


# -- an error lets go of the memory first (STORE-53, DEDUP-16) ---------------------------------


@pytest.mark.spec("STORE-51", "STORE-53")
def test_a_failed_write_raises_only_once_the_helpers_piece_is_done(
    monkeypatch: pytest.MonkeyPatch, pool: _Capturing, made: list[PieceCrc]
) -> None:
    piece = 4096
    monkeypatch.setattr(crc_pieces, "HELPER_PIECE_BYTES", piece)
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: pool)
    inside, release, left = threading.Event(), threading.Event(), threading.Event()
    main = threading.current_thread()

    def held(view: Any, value: int = 0) -> int:
        if threading.current_thread() is not main:  # the helper, on piece 1
            inside.set()
            release.wait(PATIENCE)
            out = crc32c(view, value)
            left.set()
            return out
        return crc32c(view, value)

    monkeypatch.setattr(crc_pieces, "crc32c", held)

    def write(view: memoryview) -> None:
        assert inside.wait(PATIENCE)  # the helper is inside piece 1
        threading.Timer(0.05, release.set).start()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        crc_pieces.write_checksummed(write, memoryview(os.urandom(4 * piece)), 0)
    assert left.is_set()  # the helper had finished reading the data when the error came out
    release.set()


@pytest.mark.spec("DEDUP-16", "INTEG-11")
@pytest.mark.parametrize(
    ("units", "fail"),
    [(1, None), (2, None), (5, None), (2, "owner"), (5, "owner"), (1, "helper"), (5, "helper")],
)
def test_two_ends_run_every_unit_once_and_finish_waits_for_the_helpers_unit(
    units: int, fail: str | None
) -> None:
    # The helper starts first and is held inside unit 0; the owner takes the others from the
    # back. finish() returns only after the helper's unit is done (the caller may then combine
    # or free the memory), and re-raises an error of either side.
    inside, release = threading.Event(), threading.Event()
    runs: list[int] = []
    finished: list[int] = []

    def unit(j: int) -> Callable[[], None]:
        def run() -> None:
            runs.append(j)
            if j == 0:
                inside.set()
                assert release.wait(PATIENCE)
                if fail == "helper":
                    raise ValueError("helper's unit")
            elif fail == "owner" and j == units - 1:
                raise KeyError("owner's unit")
            finished.append(j)

        return run

    work = TwoEnds([unit(j) for j in range(units)])
    helper = threading.Thread(target=work.help)
    helper.start()
    try:
        assert inside.wait(PATIENCE)
        threading.Timer(0.05, release.set).start()
        if fail is None:
            work.finish()
        else:
            with pytest.raises(ValueError if fail == "helper" else KeyError):
                work.finish()
        assert 0 in finished or fail == "helper"  # the helper's unit was over
        if fail is None:
            assert sorted(runs) == list(range(units))  # each unit once
            assert sorted(finished) == list(range(units))
    finally:
        release.set()
        helper.join(PATIENCE)


# -- the operator and table caches: bounded, and a repeated length is not rebuilt (INTEG-11) --


@pytest.fixture
def empty_caches() -> Iterator[None]:
    """The per-length caches emptied for the test and given back afterwards."""
    saved = (dict(crc_pieces._BY_LENGTH), dict(crc_pieces._TABLES))
    crc_pieces._BY_LENGTH.clear()
    crc_pieces._TABLES.clear()
    try:
        yield
    finally:
        crc_pieces._BY_LENGTH.clear()
        crc_pieces._BY_LENGTH.update(saved[0])
        crc_pieces._TABLES.clear()
        crc_pieces._TABLES.update(saved[1])


@pytest.mark.spec("INTEG-11")
@pytest.mark.usefixtures("empty_caches")
def test_the_operator_cache_keeps_a_repeated_length_and_stays_bounded() -> None:
    value = 0x89ABCDEF
    sizes: list[int] = []
    for n in range(1, 150):  # more distinct lengths than the cache holds, twice over
        got = crc_pieces.crc32c_shift(value, n)
        assert got ^ _crc(bytes(n)) == _crc(bytes(n), value)  # the shift over n zero bytes
        sizes.append(len(crc_pieces._BY_LENGTH))
    assert max(sizes) == 65  # at most 65 lengths, and that many are kept
    crc_pieces._BY_LENGTH.clear()
    first = crc_pieces._operator(4096)
    crc_pieces._operator(77)  # another length in between
    assert crc_pieces._operator(4096) is first  # not rebuilt


@pytest.mark.spec("INTEG-11", "LOAD-14")
@pytest.mark.usefixtures("empty_caches")
def test_the_table_cache_keeps_a_repeated_piece_size_and_stays_bounded() -> None:
    # A PieceCrc combines its full pieces with tables built for its piece size.
    sizes: list[int] = []
    for piece in range(1, 30):
        data = os.urandom(3 * piece + 1)
        pieces = PieceCrc(memoryview(data), piece, 9, None)
        assert pieces.result() == _crc(data, 9)
        assert piece in crc_pieces._TABLES
        sizes.append(len(crc_pieces._TABLES))
    assert max(sizes) == 9  # at most 9 piece sizes, and that many are kept
    crc_pieces._TABLES.clear()
    data = os.urandom(4 * 512)
    PieceCrc(memoryview(data), 512, 0, None).result()
    first = crc_pieces._TABLES[512]
    PieceCrc(memoryview(data), 300, 0, None).result()  # another piece size in between
    assert PieceCrc(memoryview(data), 512, 0, None).result() == _crc(data)
    assert crc_pieces._TABLES[512] is first  # not rebuilt


# -- the helper pool: one per process (STORE-49), its size a matter of speed -------------------


@pytest.mark.spec("STORE-49")
def test_the_pool_is_kept_within_a_process_and_replaced_after_a_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stale = ThreadPoolExecutor(1)  # stands for the pool of the parent a child was forked from
    monkeypatch.setattr(crc_pieces, "_POOL", (os.getpid() + 1, stale))
    try:
        mine = crc_pieces._pool()
        assert mine is not stale  # a pool started by another process is never used
        assert crc_pieces._pool() is mine  # this process's own pool is kept
        assert mine.submit(lambda: 6 * 7).result(PATIENCE) == 42
        mine.shutdown(wait=True)
    finally:
        stale.shutdown(wait=True)


@pytest.mark.spec("INTEG-11", "DEDUP-16", "LOAD-14")
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_crcs_do_not_depend_on_how_many_helper_threads_the_pool_has(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    # Several pipelines share the pool at once (more than it has threads when it has one): a
    # helper that waits for a thread is a helper that starts late, which changes nothing.
    with ThreadPoolExecutor(workers) as shared:
        monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: shared)
        monkeypatch.setattr(crc_pieces, "EACH_SHARE_MIN_BYTES", 0)
        monkeypatch.setattr(crc_pieces, "HELPER_PIECE_BYTES", 4096)
        blobs = [os.urandom(n) for n in (0, 1, 4096, 3 * 4096 + 5, 9 * 4096)]
        views = [memoryview(b) for b in blobs]
        lines = [PieceCrc(v, 1000, 17, shared) for v in views]
        for pieces in lines:
            pieces.allow(pieces.count)
        assert crc_pieces.crc32c_each(views, [5] * len(views)) == [_crc(b, 5) for b in blobs]
        assert [p.result() for p in lines] == [_crc(b, 17) for b in blobs]
        written: list[bytes] = []
        got = crc_pieces.write_checksummed(lambda v: written.append(bytes(v)), views[-1], 3)
        assert got == _crc(blobs[-1], 3) and b"".join(written) == blobs[-1]


# -- whether a CPU is free (LOAD-14): the CPUs this process may use, the threads running now --


@pytest.mark.spec("LOAD-14")
def test_the_cpus_are_those_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def affinity(pid: int) -> set[int]:
        asked.append(pid)
        return {2} if pid == 0 else {0, 1, 2, 3}  # this process: one CPU; others: four

    monkeypatch.setattr(crc_pieces.os, "sched_getaffinity", affinity)
    assert crc_pieces._cpus() == 1 and asked == [0]


@pytest.mark.spec("LOAD-14")
@pytest.mark.parametrize("missing", ["AttributeError", "OSError"])
@pytest.mark.parametrize(("count", "cpus"), [(3, 3), (1, 1), (None, 1)])
def test_without_an_affinity_mask_the_cpus_are_the_machines_or_one(
    monkeypatch: pytest.MonkeyPatch, missing: str, count: int | None, cpus: int
) -> None:
    if missing == "AttributeError":
        monkeypatch.delattr(crc_pieces.os, "sched_getaffinity", raising=False)
    else:

        def refused(pid: int) -> set[int]:
            raise OSError("no affinity here")

        monkeypatch.setattr(crc_pieces.os, "sched_getaffinity", refused)
    monkeypatch.setattr(crc_pieces.os, "cpu_count", lambda: count)
    assert crc_pieces._cpus() == cpus


class _File:
    def __init__(self, content: bytes) -> None:
        self.content = content

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def read(self) -> bytes:
        return self.content


@pytest.mark.spec("LOAD-14")
@pytest.mark.parametrize(
    ("loadavg", "loadavg_fn", "running"),
    [
        (b"0.52 0.58 0.59 3/812 123456\n", (9.0, 9.0, 9.0), 3.0),  # the running count, now
        (b"7.10 6.00 5.00 1/97 5\n", (9.0, 9.0, 9.0), 1.0),
        (None, (0.75, 9.0, 9.0), 1.75),  # no /proc: the 1-minute average, this thread added
        (b"", (2.0, 9.0, 9.0), 3.0),  # unreadable contents: the same fallback
        (b"a b c x/y z", (0.0, 9.0, 9.0), 1.0),
        (None, None, float("inf")),  # no figure at all: a busy machine
    ],
)
def test_the_running_count_and_its_fallbacks(
    monkeypatch: pytest.MonkeyPatch,
    loadavg: bytes | None,
    loadavg_fn: tuple[float, float, float] | None,
    running: float,
) -> None:
    def fake_open(path: str, mode: str) -> _File:
        assert (path, mode) == ("/proc/loadavg", "rb")
        if loadavg is None:
            raise FileNotFoundError(path)
        return _File(loadavg)

    def fake_getloadavg() -> tuple[float, float, float]:
        if loadavg_fn is None:
            raise OSError("no load average")
        return loadavg_fn

    monkeypatch.setattr(crc_pieces, "open", fake_open, raising=False)
    monkeypatch.setattr(crc_pieces.os, "getloadavg", fake_getloadavg)
    monkeypatch.setattr(crc_pieces, "_cpus", lambda: 4)
    assert crc_pieces._running() == running
    assert crc_pieces.idle_cpus() == 4 - running
    free = crc_pieces.helpers_if_cpu_free()
    assert (free is not None) is (running <= 3.0)
