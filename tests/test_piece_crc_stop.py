"""PieceCrc's helper stops when told and is waited for (STORE-51): it never reads the
memory after ``close()`` or ``result()`` returned, and it takes nothing after them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from refdcp.crc import pieces as crc_pieces
from refdcp.crc.kernel import crc32c
from refdcp.crc.pieces import PieceCrc

PIECE = 1 << 12


class _Capturing(ThreadPoolExecutor):
    """A one-thread pool that keeps the futures of what it was given."""

    def __init__(self) -> None:
        super().__init__(1)
        self.futures: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut = super().submit(fn, *args, **kwargs)
        self.futures.append(fut)
        return fut


def _slow_helper(monkeypatch: pytest.MonkeyPatch, log: list[float]) -> None:
    """The helper's CRCs take 0.1 s each and record when they end; the owner's are fast."""
    main = threading.main_thread()

    def slow(data: Any, value: int = 0) -> int:
        if threading.current_thread() is not main:
            time.sleep(0.1)
            out = crc32c(data, value)
            log.append(time.monotonic())
            return out
        return crc32c(data, value)

    monkeypatch.setattr(crc_pieces, "crc32c", slow)


@pytest.mark.spec("STORE-51", "STORE-53")
def test_close_waits_for_the_helpers_piece_and_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[float] = []
    _slow_helper(monkeypatch, log)
    data = bytes(range(256)) * (4 * PIECE // 256)
    pool = _Capturing()
    pieces = PieceCrc(memoryview(data), PIECE, 0, pool)
    pieces.allow(4)  # the helper may take every piece
    time.sleep(0.05)  # it is inside piece 0
    pieces.close()
    closed_at = time.monotonic()
    pool.futures[0].result(timeout=5)  # the helper returned
    time.sleep(0.3)  # a helper left running would compute more pieces now
    assert len(log) == 1 and log[0] <= closed_at  # waited for; nothing taken after close
    pool.shutdown()


@pytest.mark.spec("STORE-51", "STORE-53")
def test_close_wakes_a_helper_waiting_for_its_next_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _Capturing()
    pieces = PieceCrc(memoryview(bytes(4 * PIECE)), PIECE, 0, pool)
    time.sleep(0.05)  # the helper waits: no piece is allowed yet
    pieces.close()
    pool.futures[0].result(timeout=5)  # woken, and returned without taking any
    assert pieces.helper_pieces == 0
    pool.shutdown()


@pytest.mark.spec("STORE-51", "INTEG-11")
def test_result_waits_for_the_helper_and_combines_every_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[float] = []
    _slow_helper(monkeypatch, log)
    data = bytes(range(256)) * (4 * PIECE // 256) + b"tail"
    pool = _Capturing()
    pieces = PieceCrc(memoryview(data), PIECE, 7, pool)
    pieces.allow(2)
    time.sleep(0.05)  # the helper is inside piece 0; pieces 2.. are nobody's yet
    value = pieces.result()
    done_at = time.monotonic()
    pool.futures[0].result(timeout=5)
    time.sleep(0.3)
    assert value == int(crc32c(data, 7))  # continued from the start value (INTEG-11)
    assert log and max(log) <= done_at  # the helper's pieces ended before result returned
    assert len(log) == pieces.helper_pieces <= 2  # it took nothing after result()
    pool.shutdown()


@pytest.mark.spec("INTEG-11")
@pytest.mark.parametrize("crc", [0, 1, 0xFF, 0x100, 0xFF00FF00, 0x00FF00FF, 0x12003400, 0xFFFFFFFF])
@pytest.mark.parametrize("n", [1, 4096, 4 << 20])
def test_the_table_shift_equals_the_matrix_shift_for_every_register_byte(crc: int, n: int) -> None:
    # registers with zero bytes and with every byte set exercise each table's first and
    # last entries; the piece size takes the table path inside _then, other sizes the matrix
    from refdcp.crc.pieces import _TABLES, _shift_by_tables, _then, crc32c_shift

    _TABLES.pop(n, None)  # every case builds its tables (a cached table hides their making)
    assert _shift_by_tables(crc, n) == crc32c_shift(crc, n)
    assert _then(crc, 5, n, n) == _then(crc, 5, n, n + 1) == crc32c_shift(crc, n) ^ 5


@pytest.mark.spec("INTEG-11")
def test_combining_pieces_equals_one_pass_over_random_data() -> None:
    import random

    from refdcp.crc.pieces import crc32c_combine

    rng = random.Random(11)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 300))
        b = rng.randbytes(rng.randrange(0, 300))
        seed = rng.getrandbits(32)
        assert crc32c_combine(int(crc32c(a, seed)), int(crc32c(b)), len(b)) == int(
            crc32c(a + b, seed)
        )


@pytest.mark.spec("STORE-51")
def test_result_wakes_a_helper_waiting_for_its_next_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[float] = []
    _slow_helper(monkeypatch, log)
    data = bytes(4 * PIECE)
    pool = _Capturing()
    pieces = PieceCrc(memoryview(data), PIECE, 0, pool)
    pieces.allow(1)
    time.sleep(0.25)  # the helper did piece 0 and now waits for piece 1 to be allowed
    assert pieces.result() == int(crc32c(data))
    pool.futures[0].result(timeout=5)  # woken by result(), it returned: no thread left waiting
    assert pieces.helper_pieces == 1
    pool.shutdown()
