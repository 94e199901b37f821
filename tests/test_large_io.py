"""Large-item reads: the CRC kernel (INTEG-9), the default check on a helper thread
(LOAD-13) and offline verification in bounded memory (INTEG-10)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import crc32c as crc32c_package
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import refdcp
import refdcp.crc.pieces as crc_pieces
import refdcp.storage.fs.checked_read as checked_read
import refdcp.storage.verify as verify_mod
from refdcp.crc.kernel import KERNEL, KERNELS, crc32c
from refdcp.errors import CheckpointError
from refdcp.storage import CorruptionError, FileSystemWriter
from refdcp.storage.format.items import checksum_of, data_offset_of, raw_view
from refdcp.storage.verify import verify_checkpoint

SINGLE_PATH = "tests the default path's large-item CRC kernel and helper-thread check (INTEG-9, LOAD-13, INTEG-10), speed idioms the reference does without (REF-7)"

MiB = 1 << 20


@pytest.mark.spec("INTEG-9")
def test_crc_is_standard_crc32c_whatever_the_kernel() -> None:
    assert crc32c is KERNELS[KERNEL]
    assert "crc32c" in KERNELS  # the fallback is always there
    from refdcp.crc.kernel import crc32c_small

    for kernel in [*KERNELS.values(), crc32c_small]:
        assert kernel(b"123456789") == 0xE3069283
        assert kernel(b"") == 0
        assert kernel(b"6789", kernel(b"12345")) == 0xE3069283


@pytest.mark.spec("INTEG-9")
def test_without_fastcrc_the_crc32c_package_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the module imported with fastcrc missing falls back, same values."""
    import importlib.util
    import sys

    import refdcp.crc.kernel as crc_mod

    monkeypatch.setitem(sys.modules, "fastcrc", None)  # "import fastcrc" raises ImportError
    spec = importlib.util.spec_from_file_location("_crc_without_fastcrc", crc_mod.__file__)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.KERNEL == "crc32c" and set(probe.KERNELS) == {"crc32c"}
    assert probe.crc32c(b"123456789") == 0xE3069283 == crc32c(b"123456789")


@pytest.mark.spec("INTEG-9")
@given(data=st.binary(max_size=3000), cut=st.integers(0, 3000), start=st.integers(0, 2**32 - 1))
def test_crc_kernels_agree_and_continue(data: bytes, cut: int, start: int) -> None:
    want = crc32c_package.crc32c(data, start)
    cut = min(cut, len(data))
    view = memoryview(bytearray(data))  # writable buffers, as the reader passes them
    for kernel in KERNELS.values():
        assert kernel(view, start) == want
        assert kernel(view[cut:], kernel(view[:cut], start)) == want


@pytest.mark.spec("INTEG-9")
def test_recorded_checksums_are_the_crc32c_package_values(tmp_path: Path) -> None:
    """Checkpoints written with the fast kernel verify with the reference one, and back."""
    src = {"w": torch.randn(3, 1000), "b": torch.arange(7)}
    md = refdcp.save(src, storage_writer=FileSystemWriter(tmp_path, sync_files=False), no_dist=True)
    for info in md.storage_data.values():
        blob = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert checksum_of(info) == crc32c_package.crc32c(blob)


def _save_large(path: Path, n_floats: int) -> tuple[dict[str, torch.Tensor], Any]:
    src = {"big": torch.randn(n_floats), "small": torch.ones(5)}
    md = refdcp.save(src, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    return src, md


def _info(md: Any, fqn: str) -> Any:
    return next(s for i, s in md.storage_data.items() if i.fqn == fqn)


def _flip(path: Path, info: Any, at: int) -> None:
    f = path / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[info.offset + at] ^= 0x01
    f.write_bytes(bytes(raw))


def _helpers_when(cpus: int) -> Any:
    """``checked_read._helpers`` as on a machine with ``cpus`` CPUs and one busy (LOAD-14)."""
    return lambda: crc_pieces._pool() if cpus > 1 else None


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Threaded checking from 1 MiB in 64 KiB pieces, so the tests stay small; records, per
    checked item that used the helper, how many pieces the helper took."""
    return record_helper_pieces(monkeypatch, _helpers_when(2))  # a CPU idle, whatever the load


def record_helper_pieces(monkeypatch: pytest.MonkeyPatch, helpers: Any) -> list[int]:
    """Threaded checking from 1 MiB in 64 KiB pieces with ``helpers``; the returned list gets,
    per checked item that used the helper, how many pieces the helper took."""
    monkeypatch.setattr(checked_read, "THREAD_MIN_BYTES", MiB)
    monkeypatch.setattr(checked_read, "THREAD_PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(checked_read, "_helpers", helpers)
    used: list[int] = []

    class Recorded(crc_pieces.PieceCrc):
        def result(self) -> int:
            value = super().result()
            used.append(self.helper_pieces)
            return value

    monkeypatch.setattr(checked_read, "PieceCrc", Recorded)
    return used


@pytest.mark.spec("LOAD-13", "LOAD-10", "LOAD-17")
@pytest.mark.parametrize("cpus", [2, 1])
@pytest.mark.parametrize("where", ["first", "middle", "last", "header", "tail"])
def test_default_check_of_a_large_item_finds_any_flipped_byte(
    tmp_path: Path,
    small_pieces: list[int],
    monkeypatch: pytest.MonkeyPatch,
    cpus: int,
    where: str,
) -> None:
    monkeypatch.setattr(checked_read, "_helpers", _helpers_when(cpus))
    n = (3 * MiB) // 4 + 5  # 3 MiB + 20 bytes: many pieces and a partial last one
    src, md = _save_large(tmp_path, n)
    dest = {"big": torch.zeros(n), "small": torch.zeros(5)}
    refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)  # intact: bit-exact
    assert torch.equal(dest["big"], src["big"]) and torch.equal(dest["small"], src["small"])
    assert bool(small_pieces) == (cpus > 1)  # the helper thread ran only with a CPU free
    info = _info(md, "big")
    start, nbytes = data_offset_of(info), 4 * n
    at = {
        "first": start,
        "middle": start + nbytes // 2,
        "last": start + nbytes - 1,
        "header": 0,
        "tail": info.length - 1,
    }[where]
    _flip(tmp_path, info, at)
    with pytest.raises(CheckpointError) as err:
        refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)
    exc = err.value.rank_failures[0].exception
    assert isinstance(exc, CorruptionError), exc
    assert exc.fqn == "big" and exc.file == info.relative_path and exc.offset == info.offset


@pytest.mark.spec("LOAD-13")
@pytest.mark.parametrize("cpus", [2, 1])
def test_checked_read_of_a_truncated_file_names_item(
    tmp_path: Path, small_pieces: list[int], monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    monkeypatch.setattr(checked_read, "_helpers", _helpers_when(cpus))
    n = MiB // 2
    _src, md = _save_large(tmp_path, n)
    info = _info(md, "big")
    f = tmp_path / info.relative_path
    cut = info.offset + data_offset_of(info) + 3 * n // 2  # inside the data
    os.truncate(f, cut)
    fd = os.open(f, os.O_RDONLY)
    try:
        dest = torch.zeros(n)
        with pytest.raises(CorruptionError, match="truncated") as err:
            checked_read.read_checked_into(fd, raw_view(dest), info, "big", info.relative_path)
        assert err.value.fqn == "big" and err.value.offset == cut
    finally:
        os.close(fd)


@pytest.mark.spec("LOAD-13")
def test_threaded_check_works_in_a_forked_child(tmp_path: Path, small_pieces: list[int]) -> None:
    """A child forked after a checked load gets its own helper thread (no hang)."""
    n = MiB // 2
    src, _md = _save_large(tmp_path, n)
    dest = {"big": torch.zeros(n), "small": torch.zeros(5)}
    refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)  # the parent's helper exists now
    assert small_pieces
    got = {"big": torch.zeros(n), "small": torch.zeros(5)}
    want = src["big"].numpy().tobytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork; refdcp's must
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                refdcp.load(got, checkpoint_id=tmp_path, no_dist=True)
                code = 0 if got["big"].numpy().tobytes() == want else 2
            finally:
                os._exit(code)
    finally:
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's checked load hung")


@pytest.mark.spec("INTEG-10", "INTEG-6")
@pytest.mark.parametrize("where", ["first", "last", "tail"])
def test_verify_streams_large_items_and_names_the_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.setattr(verify_mod, "PIECE_BYTES", 64 << 10)
    asked: list[int] = []
    real = verify_mod._FileRanges.__call__

    def spy(self: Any, name: str, offset: int, length: int) -> bytes | None:
        asked.append(length)
        return real(self, name, offset, length)

    monkeypatch.setattr(verify_mod._FileRanges, "__call__", spy)
    n = MiB // 4 + 3
    _src, md = _save_large(tmp_path, n)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.items_checked == 2
    assert max(asked) <= 64 << 10 and len(asked) > 16  # read in pieces, never whole
    info = _info(md, "big")
    at = {"first": data_offset_of(info), "last": data_offset_of(info) + 4 * n - 1}.get(
        where, info.length - 1
    )
    _flip(tmp_path, info, at)
    report = verify_checkpoint(tmp_path)
    assert not report.ok
    (problem,) = report.problems
    assert problem.fqn == "big" and problem.file == info.relative_path
    assert problem.offset == info.offset and "checksum mismatch" in problem.message


@pytest.mark.spec("INTEG-10")
def test_verify_reports_a_truncated_large_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify_mod, "PIECE_BYTES", 64 << 10)
    n = MiB // 4
    _src, md = _save_large(tmp_path, n)
    info = _info(md, "big")
    os.truncate(tmp_path / info.relative_path, info.offset + info.length - 100_000)
    problems = {p.fqn: p for p in verify_checkpoint(tmp_path).problems}
    assert "truncated" in problems["big"].message
    assert problems["big"].file == info.relative_path


def _in_forked_child(body: Any) -> None:
    """Run ``body()`` in a forked child; fail when it raises, returns False or hangs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork; refdcp's must
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                code = 0 if body() else 2
            finally:
                os._exit(code)
    finally:
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


@pytest.mark.spec("STORE-49")
def test_large_save_works_in_a_forked_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save's CRC helper threads are per process: a child forked after a save can save."""
    import refdcp.storage.format.items as items

    monkeypatch.setattr(items, "_ASYNC_CRC_BYTES", 64 << 10)
    _save_large(tmp_path / "parent", MiB // 4)  # the parent's CRC helper exists now
    other = {"big": torch.randn(MiB // 4), "small": torch.ones(5)}
    want = other["big"].numpy().tobytes()

    def child() -> bool:
        writer = FileSystemWriter(tmp_path / "child", sync_files=False)
        md = refdcp.save(other, storage_writer=writer, no_dist=True)
        info = _info(md, "big")
        blob = (tmp_path / "child" / info.relative_path).read_bytes()
        start = info.offset + data_offset_of(info)
        ok = checksum_of(info) == crc32c_package.crc32c(
            blob[info.offset : info.offset + info.length]
        )
        return ok and blob[start : start + len(want)] == want

    _in_forked_child(child)


@pytest.mark.spec("STORE-50", "FMT-5")
@pytest.mark.parametrize("writer_kw", [{}, {"thread_count": 2}])
def test_large_items_start_64_byte_aligned_and_torch_reads_them(
    tmp_path: Path, writer_kw: dict[str, Any]
) -> None:
    import torch.distributed.checkpoint as dcp

    src = {
        "a": torch.randint(0, 255, (MiB + 3,), dtype=torch.uint8),
        "s": torch.arange(7, dtype=torch.int8),
        "b": torch.randn(MiB // 4 + 5),
        "c": torch.randint(-9, 9, (MiB // 2 + 1,), dtype=torch.int16),
        "blob": [1, 2, 3],
    }
    writer = FileSystemWriter(tmp_path, sync_files=False, **writer_kw)
    md = refdcp.save(src, storage_writer=writer, no_dist=True)
    large = [(i.fqn, s) for i, s in md.storage_data.items() if s.length >= MiB]
    assert {fqn for fqn, _ in large} == {"a", "b", "c"}
    for _fqn, info in large:
        assert info.offset % 64 == 0 and (info.offset + data_offset_of(info)) % 64 == 0
    # the gaps belong to no item and hold zeros
    for name in {s.relative_path for s in md.storage_data.values()}:
        data = (tmp_path / name).read_bytes()
        covered = sorted(
            (s.offset, s.offset + s.length)
            for s in md.storage_data.values()
            if s.relative_path == name
        )
        end = 0
        for start, stop in covered:
            assert start >= end and set(data[end:start]) <= {0}
            end = stop
        assert end == len(data)
    assert verify_checkpoint(tmp_path).ok
    mine = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in src.items()}
    refdcp.load(mine, checkpoint_id=tmp_path, no_dist=True)
    theirs = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in src.items()
    }
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    for got in (mine, theirs):
        for k, v in src.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
