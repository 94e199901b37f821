"""Tensors of any size: zip64 framing, streamed saves, in-place loads (FMT-20..22, STORE-40..42).

The fast tests check the zip64 records on small tensors framed with forced
zip64 records and on a sparse file holding a real archive of more than
4 GiB (only its head, a few data bytes and its tail occupy the disk); the
slow test round-trips a tensor just over 4 GiB with torch both ways.
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.utils import _create_file_view

import refdcp.storage.format.items as items_mod
import refdcp.storage.fs.filesystem as fs_mod
from refdcp.storage import CorruptionError, FileSystemReader, FileSystemWriter
from refdcp.storage.format.items import DATA_OFFSET_ATTR, MissingChecksumError, encode_tensor
from refdcp.storage.format.zipframe import ZIP64_LIMIT, frame_for, parse_data_span
from refdcp.storage.fs.inplace import FileSlice, locate_tensor_data
from tests.test_storage_compat import DTYPES, blank, compare, local_state, make_tensor

SINGLE_PATH = "the fast path's zip64 framing and in-place reads"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*quantize.*deprecated")
warnings.filterwarnings("ignore", message="Sparse invariant checks")
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")

EOCD64 = struct.pack("<I", 0x06064B50)
LOCATOR64 = struct.pack("<I", 0x07064B50)
OVER_4GIB = (4 << 30) + (16 << 10)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _address(view: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _central_extra(archive: zipfile.ZipFile, name: str) -> bytes:
    return bytes(archive.getinfo(name).extra)


@pytest.mark.spec("FMT-20")
@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.float32, (3, 4)), (torch.bfloat16, (5, 1, 7)), (torch.int8, (0,)), (torch.bool, (9,))],
)
def test_forced_zip64_records_read_by_zipfile_and_torch(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = make_tensor(dtype, shape, 3)
    data = _raw(t)
    frame = frame_for(dtype, shape, force_zip64=True)
    assert EOCD64 in frame.tail and LOCATOR64 in frame.tail
    assert len(frame.head) % 64 == 0 and parse_data_span(frame.head) == (len(frame.head), len(data))
    # torch's reader (miniz), with the data member's zip CRC-32 left 0 as refdcp writes it
    back = torch.load(io.BytesIO(frame.head + data + frame.tail), weights_only=True)
    assert back.dtype == dtype and back.shape == shape
    assert _raw(back) == data
    # Python's zipfile, with the CRC-32 filled in so it checks every member end to end
    head, tail = frame.with_crc(zlib.crc32(data))
    with zipfile.ZipFile(io.BytesIO(head + data + tail)) as archive:
        assert archive.testzip() is None
        info = archive.getinfo("archive/data/0")
        assert info.file_size == info.compress_size == len(data)
        assert _central_extra(archive, "archive/data/0")[:2] == b"\x01\x00"  # zip64 record
        assert info.extract_version == 45
        assert archive.read("archive/data/0") == data
        assert archive.read("archive/version") == b"3\n"


@pytest.mark.spec("FMT-20", "FMT-3")
def test_frames_below_the_limit_are_the_32_bit_form() -> None:
    # pinned from the framing as it was before zip64 existed: byte-identical
    pinned = {
        (torch.float32, (3, 4)): (0x23F661E4, 512, 491),
        (torch.bfloat16, (5, 1, 7)): (0x3DA4DE10, 512, 469),
        (torch.int8, (0,)): (0x925B6760, 512, 475),
    }
    for (dtype, shape), (crc, head_len, tail_len) in pinned.items():
        frame = frame_for(dtype, shape)
        assert (zlib.crc32(frame.head + frame.tail), len(frame.head), len(frame.tail)) == (
            crc,
            head_len,
            tail_len,
        )
        assert EOCD64 not in frame.tail


def _sparse_archive(path: Path, nbytes: int, before: bytes = b"") -> tuple[int, bytes, bytes]:
    """Write ``before`` + a refdcp-framed uint8 tensor of ``nbytes`` as a sparse file.

    Only the first and last 64 data bytes are written (a pattern); the rest is
    a hole that reads as zeros.  Returns (data offset in the archive, first, last).
    """
    frame = frame_for(torch.uint8, (nbytes,))
    first, last = bytes(range(1, 65)), bytes(range(101, 165))
    with open(path, "wb") as f:
        f.write(before + frame.head + first)
        f.seek(len(before) + len(frame.head) + nbytes - len(last))
        f.write(last + frame.tail)
    return len(frame.head), first, last


@pytest.mark.spec("FMT-20")
def test_archive_over_4gib_in_a_sparse_file(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    data_at, first, last = _sparse_archive(path, OVER_4GIB)
    frame = frame_for(torch.uint8, (OVER_4GIB,))
    assert os.stat(path).st_size == len(frame.head) + OVER_4GIB + len(frame.tail)
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("archive/data/0")
        assert info.file_size == OVER_4GIB and info.header_offset < ZIP64_LIMIT
        version = archive.getinfo("archive/version")
        assert version.header_offset > ZIP64_LIMIT  # needs the offset in its zip64 record
        assert archive.read("archive/version") == b"3\n"
        assert archive.read("archive/byteorder") == b"little"
        with archive.open(info) as member:
            assert member.read(64) == first
    # torch's reader: the record table and offsets, then the tensor itself, memory-mapped
    reader = torch._C.PyTorchFileReader(str(path))
    assert reader.get_record_offset("data/0") == data_at
    assert reader.get_record("version").decode() == "3\n"
    t = torch.load(path, mmap=True, weights_only=True)
    assert t.dtype == torch.uint8 and t.shape == (OVER_4GIB,)
    assert bytes(t[:64].tolist()) == first and bytes(t[-64:].tolist()) == last
    assert int(t[1 << 32 : (1 << 32) + 64].sum()) == 0  # the hole, past 4 GiB
    fd = os.open(path, os.O_RDONLY)
    try:
        assert locate_tensor_data(fd, 0, os.fstat(fd).st_size, torch.uint8, (OVER_4GIB,)) == data_at
    finally:
        os.close(fd)


@pytest.mark.spec("FMT-20")
def test_archive_over_4gib_inside_a_data_file(tmp_path: Path) -> None:
    """As a .distcp holds it: at an offset, read through torch's file view (torch's reader path)."""
    path = tmp_path / "__0_0.distcp"
    before = b"\x00" * 1000
    data_at, first, _ = _sparse_archive(path, OVER_4GIB, before)
    length = os.stat(path).st_size - len(before)
    with open(path, "rb") as f:
        view = _create_file_view(f, len(before), length)
        reader = torch._C.PyTorchFileReader(view)
        assert reader.get_record_offset("data/0") == data_at
        with zipfile.ZipFile(FileSlice(f.fileno(), len(before), length)) as archive:  # type: ignore[arg-type]
            assert archive.getinfo("archive/data/0").file_size == OVER_4GIB
            with archive.open("archive/data/0") as member:
                assert member.read(64) == first
        got = locate_tensor_data(f.fileno(), len(before), length, torch.uint8, (OVER_4GIB,))
        assert got == data_at


@pytest.fixture
def forced_zip64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor item refdcp writes uses zip64 records."""

    def forced(dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        return frame_for(dtype, shape, force_zip64=True)

    monkeypatch.setattr(items_mod, "frame_for", forced)


@pytest.mark.spec("FMT-20", "FMT-21", "STORE-14")
@pytest.mark.usefixtures("forced_zip64")
def test_zip64_checkpoint_crosses_to_torch_and_back(tmp_path: Path) -> None:
    sd = local_state(0, 1)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "r"))
    for reader, verify in [
        (dcp.FileSystemReader, False),
        (FileSystemReader, False),
        (FileSystemReader, True),
    ]:
        out = blank(sd)
        r = reader(tmp_path / "r")
        if verify:
            r.set_verify(True)
        dcp.load(out, storage_reader=r)
        assert compare(sd, out) == [], reader


@pytest.mark.spec("FMT-21", "FMT-22")
def test_tensors_are_framed_from_memory_without_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_torch_save(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.save called")

    monkeypatch.setattr(torch, "save", no_torch_save)
    dense = torch.arange(64.0)
    enc = encode_tensor(dense)
    assert _address(enc.parts[1]) == dense.data_ptr() and enc.data_offset == len(enc.parts[0])
    q = torch.quantize_per_channel(
        torch.randn(4, 8),
        torch.tensor([0.1, 0.2, 0.3, 0.4]),
        torch.tensor([0, 1, 2, 3]),
        0,
        torch.quint8,
    )
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([1.5, -2.0]), (3, 3))
    csr = torch.arange(12.0).reshape(3, 4).to_sparse_csr()
    for t, storages in [
        (q, [q]),
        (coo, [coo._indices(), coo._values()]),
        (csr, [csr.crow_indices(), csr.col_indices(), csr.values()]),
    ]:
        enc = encode_tensor(t)
        assert enc.data_offset is None
        addresses = {_address(p) for p in enc.parts if isinstance(p, memoryview) and len(p)}
        assert {s.untyped_storage().data_ptr() for s in storages} <= addresses
        blob = b"".join(bytes(p) for p in enc.parts)
        assert len(blob) == enc.length
        back = torch.load(io.BytesIO(blob), weights_only=True)
        assert back.layout == t.layout
        if t.is_quantized:
            assert torch.equal(back.int_repr(), t.int_repr())
            assert torch.equal(back.q_per_channel_scales(), t.q_per_channel_scales())
        else:
            assert torch.equal(back.to_dense(), t.to_dense())


@pytest.mark.spec("FMT-22", "STORE-42")
@pytest.mark.parametrize("large", [False, True])
def test_quantized_items_round_trip_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    if large:
        monkeypatch.setattr(fs_mod, "INPLACE_MIN_BYTES", 0)
    view = torch.quantize_per_tensor(torch.randn(8, 8), 0.05, 3, torch.qint8)[2:4]
    sd = {"q": torch.quantize_per_tensor(torch.randn(6, 5), 0.1, 2, torch.quint8), "view": view}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "r"))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "t"))
    for path, reader in [
        ("r", dcp.FileSystemReader),
        ("r", FileSystemReader),
        ("t", FileSystemReader),
    ]:
        out = {
            k: torch.quantize_per_tensor(torch.zeros(v.shape), 1.0, 0, v.dtype)
            for k, v in sd.items()
        }
        dcp.load(out, storage_reader=reader(tmp_path / path))
        for k, v in sd.items():
            # copy_ into a quantized destination copies the integer representation (torch too)
            assert torch.equal(out[k].int_repr(), v.int_repr()), (path, reader, k)


def _big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "flat": torch.randn(1 << 19, generator=g),  # 2 MiB
        "rows": torch.randn(512, 1024, generator=g).to(torch.bfloat16),  # 1 MiB
        "t": torch.randn(1024, 512, generator=g).t(),  # non-contiguous: torch stores it strided
        "small": torch.randn(8, generator=g),
    }


@pytest.mark.spec("STORE-40", "STORE-42", "FMT-5")
def test_large_torch_written_items_are_not_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _big_state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))
    located: list[int | None] = []

    def spy(*a: Any) -> int | None:
        located.append(locate_tensor_data(*a))
        return located[-1]

    real_blob = fs_mod.load_tensor_from_blob

    def small_only(blob: memoryview, *a: Any) -> None:
        assert len(blob) < fs_mod.INPLACE_MIN_BYTES, "a large item was read whole"
        real_blob(blob, *a)

    monkeypatch.setattr(fs_mod, "locate_tensor_data", spy)
    monkeypatch.setattr(fs_mod, "load_tensor_from_blob", small_only)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path))
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    # flat and rows are found in place; the transposed one is not (torch.load of its range)
    assert sorted(x is not None for x in located) == [False, True, True]


@pytest.mark.spec("STORE-41", "INTEG-3")
def test_verify_streams_large_items_and_never_delivers_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _big_state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    streamed: list[int] = []
    real = fs_mod.verify_streaming

    def spy(fd: int, offset: int, length: int, *a: Any) -> None:
        streamed.append(length)
        real(fd, offset, length, *a)

    monkeypatch.setattr(fs_mod, "verify_streaming", spy)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    r = FileSystemReader(tmp_path)
    r.set_verify(True)
    dcp.load(out, storage_reader=r)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert len(streamed) == 3 and min(streamed) >= items_mod.INPLACE_MIN_BYTES
    # damage the last element of the 2 MiB item: refused, and its destination untouched
    md = FileSystemReader(tmp_path).read_metadata()
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == "flat")
    at = info.offset + getattr(info, DATA_OFFSET_ATTR) + sd["flat"].nbytes - 1
    file = tmp_path / info.relative_path
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0x40
    file.write_bytes(bytes(raw))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    r = FileSystemReader(tmp_path)
    r.set_verify(True)
    with pytest.raises(BaseException, match="checksum mismatch") as err:  # dcp wraps it
        dcp.load(out, storage_reader=r)
    assert CorruptionError.__name__ in str(err.value) and "flat" in str(err.value)
    assert not out["flat"].any()


@pytest.mark.spec("STORE-41", "INTEG-5")
def test_verify_of_a_large_torch_item_needs_a_checksum(tmp_path: Path) -> None:
    sd = {"flat": torch.randn(1 << 19)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))
    r = FileSystemReader(tmp_path)
    r.set_verify(True)
    out = {"flat": torch.zeros(1 << 19)}
    with pytest.raises(BaseException, match="flat: no checksum") as err:  # dcp wraps it
        dcp.load(out, storage_reader=r)
    assert MissingChecksumError.__name__ in str(err.value)
    assert not out["flat"].any()


@pytest.mark.spec("STORE-40", "FMT-5")
def test_every_dtype_of_torch_reads_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs_mod, "INPLACE_MIN_BYTES", 0)
    sd = {str(dt): make_tensor(dt, (5, 3), i) for i, dt in enumerate(DTYPES)}
    sd["scalar"] = torch.tensor(1.5)
    sd["view"] = torch.arange(100, dtype=torch.int16)[7:40]
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))
    out = blank(sd)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path))
    assert compare(sd, out) == []


@pytest.mark.spec("STORE-40", "STORE-16")
def test_partial_read_of_a_large_torch_item_reads_only_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    full = torch.arange(1024 * 512, dtype=torch.float32).reshape(1024, 512)  # 2 MiB
    dcp.save({"t": full}, storage_writer=dcp.FileSystemWriter(tmp_path))
    reads: list[int] = []
    real_read = fs_mod._read_exact

    def spy(fd: int, view: memoryview, *a: Any) -> None:
        reads.append(len(view))
        real_read(fd, view, *a)

    monkeypatch.setattr(fs_mod, "_read_exact", spy)
    r = FileSystemReader(tmp_path)
    r.set_up_storage_reader(r.read_metadata(), True)
    got: dict[str, torch.Tensor] = {}

    class P(DefaultLoadPlanner):
        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            got["dst"] = torch.zeros(10, 6)
            return got["dst"]

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            got["committed"] = tensor

    index = MetadataIndex("t", [0, 0])
    item = ReadItem(
        LoadItemType.TENSOR,
        index,
        torch.Size([0, 0]),
        index,
        torch.Size([300, 7]),
        torch.Size([10, 6]),
    )
    r.read_data(LoadPlan([item]), P()).wait()
    assert torch.equal(got["committed"], full[300:310, 7:13])
    assert reads == [10 * 512 * 4]  # only the ten rows, straight from the file


# -- a tensor just over 4 GiB, for real (make test-thorough) ----------------------------------

_CHUNK = 16 << 20


def _block() -> torch.Tensor:
    return torch.randint(
        0, 256, (_CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )


def _fill(t: torch.Tensor) -> None:
    """Chunk k holds a fixed random block plus k (mod 256): cheap to make and to check."""
    block = _block()
    for k, s in enumerate(range(0, t.numel(), _CHUNK)):
        e = min(s + _CHUNK, t.numel())
        torch.add(block[: e - s], k % 256, out=t[s:e])


def _matches(t: torch.Tensor) -> bool:
    block = _block()
    n = t.numel()
    return t.shape == (OVER_4GIB,) and all(
        torch.equal(t[s : min(s + _CHUNK, n)], block[: min(s + _CHUNK, n) - s] + (k % 256))
        for k, s in enumerate(range(0, n, _CHUNK))
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.spec("FMT-20", "FMT-21", "STORE-14", "STORE-40", "STORE-41")
def test_tensor_over_4gib_round_trips_with_torch_both_ways(tmp_path: Path) -> None:
    t = torch.empty(OVER_4GIB, dtype=torch.uint8)
    _fill(t)
    dcp.save({"big": t}, storage_writer=FileSystemWriter(tmp_path / "r"))
    dcp.save({"big": t}, storage_writer=dcp.FileSystemWriter(tmp_path / "t"))
    del t
    md = FileSystemReader(tmp_path / "r").read_metadata()
    (info,) = md.storage_data.values()
    assert getattr(info, DATA_OFFSET_ATTR) is not None and info.length > ZIP64_LIMIT
    dest = torch.zeros(OVER_4GIB, dtype=torch.uint8)
    dcp.load({"big": dest}, storage_reader=dcp.FileSystemReader(tmp_path / "r"))
    assert _matches(dest), "torch <- refdcp"
    dest.zero_()
    r = FileSystemReader(tmp_path / "t")
    dcp.load({"big": dest}, storage_reader=r)
    assert _matches(dest), "refdcp <- torch"
    dest.zero_()
    r = FileSystemReader(tmp_path / "r")
    r.set_verify(True)
    dcp.load({"big": dest}, storage_reader=r)
    assert _matches(dest), "refdcp <- refdcp (verified)"
