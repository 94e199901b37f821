"""CRC-32C in pieces shared with a helper thread: combining (INTEG-11), the pipelined
checked read (LOAD-14) and the pipelined checksummed write (STORE-51)."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import crc32c as crc32c_package
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import refdcp
import refdcp.crc.pieces as crc_pieces
import refdcp.storage.format.items as items
import refdcp.storage.fs.checked_read as checked_read
import refdcp.storage.fs.filesystem as filesystem
from refdcp.crc.pieces import PieceCrc, crc32c_combine, crc32c_shift
from refdcp.errors import CheckpointError
from refdcp.storage import CorruptionError, FileSystemWriter
from refdcp.storage.format.items import checksum_of, data_offset_of
from tests.test_large_io import record_helper_pieces

SINGLE_PATH = "tests the default path's pipelined CRC-32C on a helper thread (INTEG-11, LOAD-14, STORE-51), a speed idiom the reference does without (REF-7)"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is")

MiB = 1 << 20


def crc(data: Any, value: int = 0) -> int:
    return int(crc32c_package.crc32c(bytes(data), value))


# -- combining (INTEG-11) ---------------------------------------------------------------


@pytest.mark.spec("INTEG-11")
@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000), start=st.integers(0, 2**32 - 1))
def test_combined_crcs_are_the_crc_of_the_concatenation(a: bytes, b: bytes, start: int) -> None:
    assert crc32c_combine(crc(a, start), crc(b), len(b)) == crc(a + b, start)


@pytest.mark.spec("INTEG-11")
@pytest.mark.parametrize("n", [0, 1, 7, 4096, MiB, (4 << 20) + 3, (5 << 30) + 17])
def test_shift_is_the_register_over_zero_bytes(n: int) -> None:
    value = 0x1234ABCD
    if n <= 8 * MiB:
        assert crc32c_shift(value, n) ^ crc(bytes(n)) == crc(bytes(n), value)
    # linear in the register, whatever the length (5 GiB + 17 checked this way only)
    assert crc32c_shift(value ^ 0x0F0F0F0F, n) == crc32c_shift(value, n) ^ crc32c_shift(
        0x0F0F0F0F, n
    )
    assert crc32c_shift(0, n) == 0


# -- piece schedules (LOAD-14, STORE-51) --------------------------------------------------


class _NeverRuns(Executor):
    """A pool whose workers are all busy for good: the helper never starts."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return Future()


class _StartsLate(Executor):
    """The helper starts only after a delay (a descheduled thread)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def late() -> None:
            time.sleep(self.delay)
            fn(*args, **kwargs)

        t = threading.Thread(target=late, daemon=True)
        t.start()
        self.threads.append(t)
        return Future()


def _helpers(kind: str) -> Executor | None:
    return {
        "inline": None,
        "pool": crc_pieces._pool(),
        "never": _NeverRuns(),
        "late": _StartsLate(0.002),
    }[kind]


@pytest.mark.spec("LOAD-14", "STORE-51", "INTEG-11", "LOAD-15", "LOAD-16")
@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=5000),
    piece=st.integers(1, 700),
    start=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["inline", "pool", "never", "late"]),
    mode=st.sampled_from(["offer", "claim"]),
)
def test_the_pieces_give_the_whole_crc_whoever_computes_them(
    data: bytes, piece: int, start: int, kind: str, mode: str
) -> None:
    view = memoryview(bytearray(data))
    pieces = PieceCrc(view, piece, start, _helpers(kind))
    assert pieces.count == -(-len(data) // piece)
    for k in range(pieces.count):
        if mode == "offer":  # load: after each read
            pieces.offer(k)
        else:  # save: before each write, the helper allowed one piece ahead
            pieces.allow(k + 2)
            pieces.claim(k)
    assert pieces.result() == crc(data, start)
    if kind in ("inline", "never"):
        assert pieces.helper_pieces == 0


@pytest.mark.spec("LOAD-14", "LOAD-15")
def test_a_helper_that_keeps_up_takes_every_piece() -> None:
    data = os.urandom(64 * 4096)
    view = memoryview(bytearray(data))
    pieces = PieceCrc(view, 4096, 0, crc_pieces._pool())
    for k in range(pieces.count):
        pieces.offer(k)
        deadline = time.monotonic() + 30
        while pieces.helper_pieces <= k and time.monotonic() < deadline:
            time.sleep(0.0005)  # a slow read: the helper has taken piece k before piece k+1
    assert pieces.result() == crc(data)
    assert pieces.helper_pieces == pieces.count


@pytest.mark.spec("LOAD-14", "LOAD-15", "LOAD-16")
def test_close_waits_for_the_helper_and_stops_it() -> None:
    view = memoryview(bytearray(os.urandom(8 * MiB)))
    pieces = PieceCrc(view, MiB, 0, crc_pieces._pool())
    pieces.allow(8)
    time.sleep(0.01)
    pieces.close()
    # nothing is in progress after close: the caller may free the memory
    assert crc_pieces._TAKEN not in pieces._state


@pytest.mark.spec("LOAD-14")
@pytest.mark.parametrize(("running", "helper"), [(1.0, True), (2.0, False), (7.0, False)])
def test_a_cpu_is_free_when_fewer_threads_run_now_than_cpus(
    monkeypatch: pytest.MonkeyPatch, running: float, helper: bool
) -> None:
    monkeypatch.setattr(crc_pieces, "_cpus", lambda: 2)
    monkeypatch.setattr(crc_pieces, "_running", lambda: running)
    assert (crc_pieces.helpers_if_cpu_free() is not None) is helper


@pytest.mark.spec("LOAD-14")
def test_the_running_count_is_read_from_the_kernel() -> None:
    # this thread runs: at least one, and a number (not the 1-minute average's fraction)
    running = crc_pieces._running()
    assert running >= 1 and running == int(running)


# -- the pipelined checked read (LOAD-14, LOAD-10) ----------------------------------------


@pytest.fixture
def pipelined(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Items from 1 MiB read in 64 KiB pieces with the helper; records the helper's pieces."""
    return record_helper_pieces(monkeypatch, lambda: crc_pieces._pool())


def _save_big(path: Path, n: int) -> tuple[dict[str, torch.Tensor], Any]:
    src = {"big": torch.randn(n), "small": torch.ones(5)}
    md = refdcp.save(src, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    info = next(s for i, s in md.storage_data.items() if i.fqn == "big")
    return src, info


@pytest.mark.spec("LOAD-14", "LOAD-10", "LOAD-16", "LOAD-17")
@pytest.mark.parametrize("helper", ["pool", "never", "late"])
@pytest.mark.parametrize("where", ["middle piece", "last partial piece", None])
def test_the_pipelined_check_finds_a_flipped_byte_and_names_it(
    tmp_path: Path,
    pipelined: list[int],
    monkeypatch: pytest.MonkeyPatch,
    helper: str,
    where: str | None,
) -> None:
    monkeypatch.setattr(checked_read, "_helpers", lambda: _helpers(helper))
    n = (3 * MiB) // 4 + 5  # 3 MiB + 20 bytes: 48 pieces of 64 KiB and a partial one
    src, info = _save_big(tmp_path, n)
    start = data_offset_of(info)
    assert start is not None
    if where is not None:
        at = start + (24 * (64 << 10) + 1000 if where == "middle piece" else 4 * n - 3)
        f = tmp_path / info.relative_path
        raw = bytearray(f.read_bytes())
        raw[info.offset + at] ^= 0x40
        f.write_bytes(bytes(raw))
    dest = {"big": torch.zeros(n), "small": torch.zeros(5)}
    if where is None:
        refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)
        assert torch.equal(dest["big"], src["big"])
        assert len(pipelined) == 1  # the big item went through the pipeline
        if helper == "never":
            assert pipelined == [0]  # all computed by the reading thread
        return
    with pytest.raises(CheckpointError) as err:
        refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)
    exc = err.value.rank_failures[0].exception
    assert isinstance(exc, CorruptionError) and "checksum mismatch" in str(exc)
    assert (exc.fqn, exc.file, exc.offset) == ("big", info.relative_path, info.offset)


@pytest.mark.spec("LOAD-14", "LOAD-16")
def test_the_pipelined_check_names_a_cut_file(tmp_path: Path, pipelined: list[int]) -> None:
    n = MiB // 2
    _src, info = _save_big(tmp_path, n)
    cut = info.offset + data_offset_of(info) + 3 * n // 2 + 5
    os.truncate(tmp_path / info.relative_path, cut)
    fd = os.open(tmp_path / info.relative_path, os.O_RDONLY)
    try:
        dest = torch.zeros(n)
        with pytest.raises(CorruptionError, match="truncated") as err:
            checked_read.read_checked_into(fd, items.raw_view(dest), info, "big", "f")
        assert (err.value.fqn, err.value.offset) == ("big", cut)
    finally:
        os.close(fd)


# -- the pipelined checksummed write (STORE-51) ---------------------------------------------


@pytest.fixture
def small_write_pieces(monkeypatch: pytest.MonkeyPatch) -> list[PieceCrc]:
    """Large-item writes in 64 KiB pieces from 256 KiB on; records the pipelines used."""
    monkeypatch.setattr(items, "_ASYNC_CRC_BYTES", 256 << 10)
    monkeypatch.setattr(crc_pieces, "INLINE_PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(crc_pieces, "HELPER_PIECE_BYTES", 64 << 10)
    used: list[PieceCrc] = []
    real = crc_pieces.PieceCrc

    class Recorded(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            used.append(self)

    monkeypatch.setattr(crc_pieces, "PieceCrc", Recorded)
    return used


@pytest.mark.spec("STORE-51", "STORE-55", "INTEG-1")
@pytest.mark.parametrize("helper", ["pool", "inline", "never", "late"])
def test_the_recorded_crc_is_of_exactly_the_bytes_written(
    tmp_path: Path,
    small_write_pieces: list[PieceCrc],
    monkeypatch: pytest.MonkeyPatch,
    helper: str,
) -> None:
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: _helpers(helper))
    src = {
        "a": torch.randn((MiB // 4) + 3),  # 1 MiB + 12 bytes: 16 pieces and a partial one
        "b": torch.randint(0, 255, ((3 << 19) + 1,), dtype=torch.uint8),
        "s": torch.arange(9),
    }
    writer = FileSystemWriter(tmp_path, sync_files=False)
    md = refdcp.save(src, storage_writer=writer, no_dist=True)
    for index, info in md.storage_data.items():
        blob = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert checksum_of(info) == crc(blob), index.fqn
    assert len(small_write_pieces) == (0 if helper == "inline" else 2)
    if helper == "pool":
        assert all(p.helper_pieces <= p.count for p in small_write_pieces)
    got = {k: torch.zeros_like(v) for k, v in src.items()}
    refdcp.load(got, checkpoint_id=tmp_path, no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in src.items())


@pytest.mark.spec("STORE-51", "STORE-31", "STORE-53")
@pytest.mark.parametrize("helper", ["pool", "inline"])
def test_a_failed_piece_write_fails_the_save_after_the_helper_let_go(
    tmp_path: Path,
    small_write_pieces: list[PieceCrc],
    monkeypatch: pytest.MonkeyPatch,
    helper: str,
) -> None:
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: _helpers(helper))
    real_writev = os.writev
    calls = [0]

    def failing(fd: int, buffers: Any) -> int:
        calls[0] += 1
        if calls[0] == 6:  # inside the large item's pieces
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, buffers)

    monkeypatch.setattr(filesystem.os, "writev", failing)
    src = {"a": torch.randn(MiB // 4)}
    with pytest.raises(BaseException) as err:
        refdcp.save(src, storage_writer=FileSystemWriter(tmp_path, sync_files=False), no_dist=True)
    assert "No space left on device" in repr(err.value)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".distcp")]  # STORE-31
    assert not (tmp_path / ".metadata").exists()
    for pieces in small_write_pieces:  # nothing reads the tensor's memory any more
        assert crc_pieces._TAKEN not in pieces._state


@pytest.mark.spec("STORE-51", "STORE-49")
def test_the_write_helper_works_in_a_forked_child(
    tmp_path: Path, small_write_pieces: list[PieceCrc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child forked after a save whose helper ran starts its own helper (no hang)."""
    from tests.test_large_io import _in_forked_child

    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: crc_pieces._pool())
    _save_big(tmp_path / "parent", MiB // 4)
    assert small_write_pieces
    other = {"big": torch.randn(MiB // 4), "small": torch.ones(5)}
    want = other["big"].numpy().tobytes()

    def child() -> bool:
        md = refdcp.save(
            other,
            storage_writer=FileSystemWriter(tmp_path / "child", sync_files=False),
            no_dist=True,
        )
        info = next(s for i, s in md.storage_data.items() if i.fqn == "big")
        blob = (tmp_path / "child" / info.relative_path).read_bytes()
        start = info.offset + data_offset_of(info)
        return checksum_of(info) == crc(blob[info.offset : info.offset + info.length]) and blob[
            start : start + len(want)
        ] == bytes(want)

    _in_forked_child(child)


@pytest.mark.spec("INTEG-11")
@given(st.integers(1, 1 << 24), st.integers(0, 0xFFFFFFFF))
@settings(max_examples=25, deadline=None)
def test_the_table_shift_of_a_fresh_length_equals_the_matrix_shift(nbytes: int, crc: int) -> None:
    # The per-length tables are built on first use of a length (only the 4 MiB
    # piece is built at import): a wrong table entry must show for any length.
    # Every cache rebuilt from scratch (the import filled them for the 4 MiB piece).
    saved = (crc_pieces._POWERS[:], dict(crc_pieces._BY_LENGTH), dict(crc_pieces._TABLES))
    try:
        del crc_pieces._POWERS[1:]
        crc_pieces._BY_LENGTH.clear()
        crc_pieces._TABLES.clear()
        got = crc_pieces._shift_by_tables(crc, nbytes)
        assert got == crc_pieces.crc32c_shift(crc, nbytes)
    finally:
        crc_pieces._POWERS[:] = saved[0]
        crc_pieces._BY_LENGTH.clear()
        crc_pieces._BY_LENGTH.update(saved[1])
        crc_pieces._TABLES.clear()
        crc_pieces._TABLES.update(saved[2])
    if nbytes <= 4096:  # against the package: crc(a + zeros) = shift(crc(a)) ^ crc(zeros)
        a = os.urandom(16)
        whole = crc32c_package.crc32c(a + bytes(nbytes))
        assert (
            crc_pieces._shift_by_tables(crc32c_package.crc32c(a), nbytes)
            ^ crc32c_package.crc32c(bytes(nbytes))
            == whole
        )


@pytest.mark.spec("STORE-51", "STORE-55", "INTEG-11")
@pytest.mark.parametrize("helper", ["inline", "pool"])
def test_write_checksummed_with_the_real_piece_sizes(
    monkeypatch: pytest.MonkeyPatch, helper: str
) -> None:
    # The module's own piece sizes (other tests shrink them): every byte written
    # once, in order, in pieces of that size, and the CRC of exactly those bytes.
    monkeypatch.setattr(crc_pieces, "helpers_if_cpu_free", lambda: _helpers(helper))
    # inline: checksummed in INLINE_PIECE_BYTES pieces, written HELPER_PIECE_BYTES at a time
    step = crc_pieces.HELPER_PIECE_BYTES
    data = memoryview(os.urandom(2 * crc_pieces.HELPER_PIECE_BYTES + 5))
    written: list[bytes] = []
    sizes: list[int] = []
    real = crc_pieces.crc32c

    def recorded(piece: Any, value: int = 0) -> int:
        sizes.append(len(piece))
        return real(piece, value)

    monkeypatch.setattr(crc_pieces, "crc32c", recorded)
    got = crc_pieces.write_checksummed(lambda v: written.append(bytes(v)), data, 7)
    crc_step = crc_pieces.INLINE_PIECE_BYTES if helper == "inline" else step
    assert max(sizes) == crc_step and sum(sizes) == len(data)  # every byte checksummed once
    assert b"".join(written) == data
    assert [len(w) for w in written[:-1]] == [step] * (len(written) - 1)
    assert len(written) == -(-len(data) // step)
    assert got == crc32c_package.crc32c(data, 7)
