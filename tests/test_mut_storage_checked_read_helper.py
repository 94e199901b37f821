"""The checked read's helper thread (LOAD-13, LOAD-14, LOAD-20; issue 28).

With a CPU free, an item of at least ``THREAD_MIN_BYTES`` has its CRC-32C
computed by a helper thread that follows the reads one piece behind: when the
helper keeps up it checksums every piece (the last one it may leave to the
reading thread); a small item is checked inline and
never handed to the helper. Either way the same damage is detected. A read that
fails part way (a file cut short) stops the helper before it returns, so no
helper task outlives the failed read, and the destination is zero-filled.

The tests stand in for "a CPU is free" by giving ``checked_read`` a recording
thread pool in place of ``helpers_if_cpu_free``'s answer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import pytest
from torch.distributed.checkpoint.filesystem import _StorageInfo

from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs import checked_read
from refdcp.storage.fs.checked_read import read_checked_into
from refdcp.storage.fs.paths import pread_into

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BASE = 40  # the item starts this far into the file
HEAD, TAIL = 64, 9


class _Helpers(Executor):
    """A one-thread pool that keeps every task it is given (a PieceCrc's helper loop)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="test-crc-helper")
        self.tasks: list[Callable[..., Any]] = []
        self.futures: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.tasks.append(fn)
        fut = self.pool.submit(fn, *args, **kwargs)
        self.futures.append(fut)
        return fut

    def release(self) -> None:
        """Stop any helper loop still waiting (only a broken read leaves one), then the pool."""
        for task in self.tasks:
            owner = getattr(task, "__self__", None)
            if owner is not None:
                owner.close()
        self.pool.shutdown(wait=True)


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Helpers]:
    h = _Helpers()
    monkeypatch.setattr(checked_read, "helpers_if_cpu_free", lambda: h)  # a CPU is free
    try:
        yield h
    finally:
        h.release()


def _write_item(path: Path, size: int) -> tuple[bytes, Any]:
    """A file holding one framed item of ``size`` data bytes at BASE; (data, its info)."""
    data = os.urandom(size)
    stored = os.urandom(HEAD) + data + b"\xee" * TAIL
    info = _StorageInfo("x.distcp", BASE, len(stored))
    info.refdcp_crc32c = crc32c.crc32c(stored)  # type: ignore[attr-defined]
    info.refdcp_data_offset = HEAD  # type: ignore[attr-defined]
    path.write_bytes(b"J" * BASE + stored + b"after")
    return data, info


def _read(path: Path, size: int, info: Any) -> bytearray:
    out = bytearray(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_checked_into(fd, memoryview(out), info, "model.w", "x.distcp")
    finally:
        os.close(fd)
    return out


def _sizes() -> list[tuple[str, Callable[[], int]]]:
    # read from the module at run time: the line is the module's constant, not a copy of it
    return [
        ("empty", lambda: 0),
        ("tiny", lambda: 5),
        ("1MiB+3", lambda: (1 << 20) + 3),
        ("min-1", lambda: checked_read.THREAD_MIN_BYTES - 1),
        ("min", lambda: checked_read.THREAD_MIN_BYTES),
        (
            "min+piece+5",
            lambda: checked_read.THREAD_MIN_BYTES + checked_read.THREAD_PIECE_BYTES + 5,
        ),
    ]


@pytest.mark.spec("LOAD-13", "LOAD-14")
@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "flipped"])
@pytest.mark.parametrize(("name", "size_of"), _sizes(), ids=[n for n, _ in _sizes()])
def test_with_a_cpu_free_exactly_the_large_items_go_to_the_helper(
    tmp_path: Path, helpers: _Helpers, damaged: bool, name: str, size_of: Callable[[], int]
) -> None:
    size = size_of()
    path = tmp_path / "f"
    data, info = _write_item(path, size)
    if damaged:
        raw = bytearray(path.read_bytes())
        raw[BASE + HEAD + size // 2 if size else BASE + 3] ^= 0x04
        path.write_bytes(bytes(raw))
        with pytest.raises(CorruptionError, match="checksum mismatch") as err:
            _read(path, size, info)
        assert (err.value.fqn, err.value.file, err.value.offset) == ("model.w", "x.distcp", BASE)
    else:
        assert bytes(_read(path, size, info)) == data
    large = size >= checked_read.THREAD_MIN_BYTES
    assert len(helpers.tasks) == (1 if large else 0), name
    for fut in helpers.futures:
        fut.result(timeout=30)  # the helper has let go of the destination


@pytest.mark.spec("LOAD-13")
def test_a_helper_that_keeps_up_checksums_the_pieces_as_they_are_read(
    tmp_path: Path, helpers: _Helpers, monkeypatch: pytest.MonkeyPatch
) -> None:
    piece = checked_read.THREAD_PIECE_BYTES
    size = checked_read.THREAD_MIN_BYTES + piece + 5
    path = tmp_path / "f"
    data, info = _write_item(path, size)
    start = BASE + HEAD
    stalled = threading.Event()

    def pread_after_the_helper(fd: int, view: memoryview, offset: int) -> int:
        """Before piece k is read, wait (bounded) until the helper has taken pieces 0..k-1."""
        k = (offset - start) // piece
        if start < offset < start + size and helpers.tasks and not stalled.is_set():
            pieces = helpers.tasks[0].__self__  # type: ignore[attr-defined]
            with pieces._cond:
                if not pieces._cond.wait_for(lambda: pieces.helper_pieces >= k, timeout=5):
                    stalled.set()  # the helper was never given piece k-1
        return pread_into(fd, view, offset)

    monkeypatch.setattr(checked_read, "pread_into", pread_after_the_helper)
    assert bytes(_read(path, size, info)) == data
    pieces = helpers.tasks[0].__self__  # type: ignore[attr-defined]
    assert not stalled.is_set()
    assert pieces.count == -(-size // piece)
    # every piece but the last was taken before the next read; the last races result()
    assert pieces.helper_pieces >= pieces.count - 1


@pytest.mark.spec("LOAD-13", "LOAD-20")
@pytest.mark.parametrize("cut_piece", [0, 1, 2])
def test_a_read_cut_short_on_the_helper_path_stops_the_helper_and_zero_fills(
    tmp_path: Path, helpers: _Helpers, cut_piece: int
) -> None:
    piece = checked_read.THREAD_PIECE_BYTES
    size = checked_read.THREAD_MIN_BYTES + 3
    path = tmp_path / "f"
    _write_item(path, size)
    cut = BASE + HEAD + cut_piece * piece + 1000
    with open(path, "r+b") as f:
        f.truncate(cut)
    out = bytearray(b"\xab" * size)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptionError, match="data file truncated") as err:
            read_checked_into(fd, memoryview(out), info_of(path, size), "model.w", "x.distcp")
    finally:
        os.close(fd)
    assert err.value.offset == cut
    assert len(helpers.tasks) == 1
    helpers.futures[0].result(timeout=10)  # stopped by the read, not left waiting for pieces
    assert out.count(0) == size  # LOAD-20: no byte of the failed read is kept


def info_of(path: Path, size: int) -> Any:
    """The info of the item ``_write_item`` wrote, for a file since cut short."""
    info = _StorageInfo("x.distcp", BASE, HEAD + size + TAIL)
    info.refdcp_crc32c = 0  # type: ignore[attr-defined]  # never reached: the read fails first
    info.refdcp_data_offset = HEAD  # type: ignore[attr-defined]
    return info
