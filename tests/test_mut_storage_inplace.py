"""Locating a torch-written tensor's elements, and streamed checks (STORE-40, STORE-41; issue 13).

``locate_tensor_data`` returns where the elements of a plain contiguous
tensor start inside a ``torch.save`` archive (the bytes there are exactly the
tensor's), and None for every archive it must not read in place.
``verify_streaming`` accepts an intact item of any size and names a damaged
or truncated one. ``FileSlice`` behaves as a seekable read-only file.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs.inplace import STREAM_CHUNK, FileSlice, locate_tensor_data, verify_streaming

PAD = 4096 + 17  # the item starts this far into its file


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture
def put(tmp_path: Path) -> Iterator[Any]:
    fds: list[int] = []

    def make(item: bytes, before: int = PAD) -> int:
        p = tmp_path / f"f{len(fds)}"
        p.write_bytes(b"\xab" * before + item + b"trailing junk")
        fds.append(os.open(p, os.O_RDONLY))
        return fds[-1]

    yield make
    for fd in fds:
        os.close(fd)


def _elements_at(fd: int, at: int, t: torch.Tensor) -> bytes:
    return os.pread(fd, t.nbytes, PAD + at)


_PLAIN = {
    "float32 2-d": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "int64 1-d": torch.arange(1000, dtype=torch.int64),
    "bool": torch.tensor([True, False, True]),
    "bfloat16": torch.arange(10, dtype=torch.bfloat16),
    "0-d": torch.tensor(3.5),
    "uint8 3-d": torch.arange(60, dtype=torch.uint8).reshape(3, 4, 5),
    "complex": torch.tensor([1 + 2j, 3 - 4j]),
}


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize("case", sorted(_PLAIN))
def test_the_elements_of_a_plain_tensor_are_located(put: Any, case: str) -> None:
    t = _PLAIN[case]
    item = _saved(t)
    fd = put(item)
    at = locate_tensor_data(fd, PAD, len(item), t.dtype, t.shape)
    assert at is not None and 0 < at < len(item)
    assert _elements_at(fd, at, t) == t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize("start", [1, 3, 7])
def test_a_view_into_a_larger_storage_is_located_at_its_storage_offset(
    put: Any, start: int
) -> None:
    base = torch.arange(20, dtype=torch.int32)
    t = base[start : start + 5]
    item = _saved(t)
    fd = put(item)
    at = locate_tensor_data(fd, PAD, len(item), torch.int32, [5])
    assert at is not None
    assert _elements_at(fd, at, t) == t.numpy().tobytes()
    at0 = locate_tensor_data(fd, PAD, len(item), torch.int32, [5])
    assert at0 == at
    whole = _saved(base)
    fd2 = put(whole)
    at_whole = locate_tensor_data(fd2, PAD, len(whole), torch.int32, [20])
    assert at_whole is not None and at == at_whole + 4 * start


def _deflated(item: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(item))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            kind = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=kind)
    return out.getvalue()


def _without_pickle(item: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(item))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("data.pkl"):
                dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def _foreign_persistent_id(item: bytes) -> bytes:
    """The archive with its data.pkl naming a persistent id of another kind than 'storage'."""
    src = zipfile.ZipFile(io.BytesIO(item))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"storage" in data
                data = data.replace(b"storage", b"xtorage", 1)
            dst.writestr(info.filename, data)
    return out.getvalue()


_T = torch.arange(12, dtype=torch.float32).reshape(3, 4)


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize(
    ("case", "item", "dtype", "sizes"),
    [
        ("wrong dtype", _saved(_T), torch.float64, [3, 4]),
        ("wrong shape", _saved(_T), torch.float32, [4, 3]),
        ("wrong ndim", _saved(_T), torch.float32, [12]),
        ("non-contiguous", _saved(_T.t()), torch.float32, [4, 3]),
        ("a dict", _saved({"t": _T}), torch.float32, [3, 4]),
        ("a list of two tensors", _saved([_T, _T + 1]), torch.float32, [3, 4]),
        ("a plain int", _saved(5), torch.float32, [3, 4]),
        ("a sparse tensor", _saved(_T.to_sparse()), torch.float32, [3, 4]),
        ("a deflated member", _deflated(_saved(_T)), torch.float32, [3, 4]),
        ("no data.pkl", _without_pickle(_saved(_T)), torch.float32, [3, 4]),
        ("a foreign persistent id", _foreign_persistent_id(_saved(_T)), torch.float32, [3, 4]),
        ("not a zip", b"\x00" * 300, torch.float32, [3, 4]),
        ("a legacy pickle", b"\x80\x02}q\x00." + b"\x00" * 30, torch.float32, [3, 4]),
    ],
)
def test_archives_not_to_read_in_place_give_none(
    put: Any, case: str, item: bytes, dtype: torch.dtype, sizes: list[int]
) -> None:
    fd = put(item)
    assert locate_tensor_data(fd, PAD, len(item), dtype, sizes) is None


@pytest.mark.spec("STORE-40")
def test_an_archive_cut_short_or_misplaced_gives_none(put: Any) -> None:
    item = _saved(_T)
    fd = put(item)
    assert locate_tensor_data(fd, PAD, len(item), torch.float32, [3, 4]) is not None
    assert locate_tensor_data(fd, PAD, len(item) - 1, torch.float32, [3, 4]) is None
    assert locate_tensor_data(fd, PAD + 1, len(item), torch.float32, [3, 4]) is None
    assert locate_tensor_data(fd, PAD, 10, torch.float32, [3, 4]) is None


@pytest.mark.spec("STORE-40")
def test_a_damaged_local_header_gives_none(put: Any) -> None:
    item = bytearray(_saved(_T))
    member = next(
        i for i in zipfile.ZipFile(io.BytesIO(bytes(item))).infolist() if "/data/" in i.filename
    )
    item[member.header_offset] ^= 0xFF  # the local header's signature
    fd = put(bytes(item))
    assert locate_tensor_data(fd, PAD, len(item), torch.float32, [3, 4]) is None


@pytest.mark.spec("STORE-40")
def test_file_slice_reads_seeks_and_stops_at_its_end(put: Any) -> None:
    payload = bytes(range(256)) * 4
    fd = put(payload)
    s = FileSlice(fd, PAD, 100)
    assert s.readable() and s.seekable() and s.tell() == 0
    assert s.read(10) == payload[:10] and s.tell() == 10
    assert s.seek(5, io.SEEK_CUR) == 15 and s.read(5) == payload[15:20]
    assert s.seek(-10, io.SEEK_END) == 90 and s.read(50) == payload[90:100]
    assert s.read(1) == b"" and s.tell() == 100
    assert s.seek(-1000, io.SEEK_CUR) == 0  # clamped at the start
    assert s.seek(3) == 3 and s.read() == payload[3:100]
    assert s.seek(200) == 200 and s.read(4) == b""
    buf = bytearray(8)
    s.seek(96)
    assert s.readinto(buf) == 4 and bytes(buf[:4]) == payload[96:100]
    arr = torch.zeros(2, dtype=torch.int32).numpy()
    s.seek(0)
    assert s.readinto(arr) == 8 and arr.tobytes() == payload[:8]


# -- verify_streaming (STORE-41) -------------------------------------------------------------


@pytest.mark.spec("STORE-41")
@pytest.mark.parametrize("size", [0, 1, 1000, STREAM_CHUNK, STREAM_CHUNK + 5])
def test_an_intact_item_of_any_size_passes(put: Any, size: int) -> None:
    item = bytes((i * 7) % 256 for i in range(min(size, 4096))) * (size // 4096 + 1)
    item = item[:size]
    fd = put(item)
    verify_streaming(fd, PAD, size, crc32c.crc32c(item), "w", "f.distcp")


@pytest.mark.spec("STORE-41")
@pytest.mark.parametrize("size", [1, 1000, STREAM_CHUNK + 5])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_damaged_item_is_named(put: Any, size: int, where: str) -> None:
    item = bytearray(b"\x11" * size)
    crc = crc32c.crc32c(bytes(item))
    item[0 if where == "first" else size - 1] ^= 4
    fd = put(bytes(item))
    with pytest.raises(CorruptionError, match=f"stored {crc:08x}") as err:
        verify_streaming(fd, PAD, size, crc, "w", "f.distcp")
    assert (err.value.fqn, err.value.file, err.value.offset) == ("w", "f.distcp", PAD)


@pytest.mark.spec("STORE-41")
@pytest.mark.parametrize("size", [10, STREAM_CHUNK + 100])
def test_a_truncated_item_is_named(tmp_path: Path, size: int) -> None:
    item = b"\x22" * size
    p = tmp_path / "f"
    p.write_bytes(b"\0" * PAD + item[: size - 3])
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(
            CorruptionError, match=f"item truncated: {size - 3} of {size} bytes"
        ) as e:
            verify_streaming(fd, PAD, size, crc32c.crc32c(item), "w", "f.distcp")
        assert e.value.offset == PAD and e.value.fqn == "w"
    finally:
        os.close(fd)


@pytest.mark.spec("STORE-41")
def test_streamed_verification_holds_at_most_8_mib(tmp_path: Path) -> None:
    import tracemalloc

    size = 20 << 20
    p = tmp_path / "big"
    with open(p, "wb") as f:
        f.truncate(PAD + size)  # sparse: zeros
    crc = crc32c.crc32c(bytes(1 << 20))
    for _ in range(19):
        crc = crc32c.crc32c(bytes(1 << 20), crc)
    fd = os.open(p, os.O_RDONLY)
    try:
        tracemalloc.start()
        verify_streaming(fd, PAD, size, crc, "w", "big")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.close(fd)
    assert peak <= (8 << 20) + (64 << 10), peak
