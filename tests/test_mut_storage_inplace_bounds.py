"""The bounds of reading a torch-written tensor in place (STORE-40; issue 28).

``locate_tensor_data`` reads in place exactly when the whole storage ``data.pkl``
describes lies in one stored member, that member inside the item (its last byte
may be the item's last), and ``data.pkl`` is at most 16 MiB. Archives are made by
``torch.save`` and then edited: ``data.pkl`` padded or given another storage size,
or the data member's recorded size changed in the central directory.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from refdcp.storage.fs.inplace import locate_tensor_data

PAD = 4096 + 5  # the item starts this far into its file
MAX_PICKLE = 16 << 20


@pytest.fixture
def put(tmp_path: Path) -> Iterator[Any]:
    fds: list[int] = []

    def make(item: bytes) -> int:
        p = tmp_path / f"f{len(fds)}"
        p.write_bytes(b"\xcd" * PAD + item + b"trailing bytes, not the item's")
        fds.append(os.open(p, os.O_RDONLY))
        return fds[-1]

    yield make
    for fd in fds:
        os.close(fd)


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _with_pickle(item: bytes, pkl: bytes) -> bytes:
    """The archive with its ``data.pkl`` replaced, every member stored."""
    src = zipfile.ZipFile(io.BytesIO(item))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def _pickle_of(item: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(item))
    return next(src.read(i) for i in src.infolist() if i.filename.endswith("/data.pkl"))


_LOCATION = b"X\x03\x00\x00\x00cpu"


def _padded_location(pkl: bytes, total: int) -> bytes:
    """``pkl`` with its storage's location string lengthened so the pickle is ``total``
    bytes (the location names a device; reading in place never uses it)."""
    pad = total - len(pkl)
    assert pkl.count(_LOCATION) == 1 and pad >= 0
    longer = b"X" + struct.pack("<I", 3 + pad) + b"cpu" + b" " * pad
    return pkl.replace(_LOCATION, longer)


def _with_numel(pkl: bytes, numel: int) -> bytes:
    """``pkl`` with the element count of its storage's persistent id replaced."""
    at = pkl.index(_LOCATION) + len(_LOCATION)
    assert pkl[at : at + 1] == b"q"  # BINPUT of the location
    at += 2
    width = {b"K": 1, b"M": 2, b"J": 4}[pkl[at : at + 1]]
    return pkl[:at] + b"J" + struct.pack("<i", numel) + pkl[at + 1 + width :]


def _data_member(item: bytes) -> tuple[int, int]:
    """(where the data member's central directory record starts, where its data starts)."""
    archive = zipfile.ZipFile(io.BytesIO(item))
    info = next(i for i in archive.infolist() if "/data/" in i.filename)
    name = info.filename.encode()
    record = item.index(b"PK\x01\x02")
    while item[record + 46 : record + 46 + len(name)] != name:
        record = item.index(b"PK\x01\x02", record + 4)
    name_len, extra_len = struct.unpack_from("<HH", item, info.header_offset + 26)
    return record, info.header_offset + 30 + name_len + extra_len


def _with_member_size(item: bytes, size: int) -> bytes:
    record, _ = _data_member(item)
    out = bytearray(item)
    struct.pack_into("<II", out, record + 20, size, size)  # compressed, uncompressed size
    return bytes(out)


_TENSORS = {
    "uint8": torch.arange(7, dtype=torch.uint8),
    "bfloat16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    "int32": torch.arange(5, dtype=torch.int32),
    "float64": torch.arange(12, dtype=torch.float64).reshape(3, 4),
}


@pytest.mark.spec("STORE-40")
def test_a_data_pkl_of_exactly_16_mib_is_still_read_in_place(put: Any) -> None:
    t = torch.arange(10, dtype=torch.float32)
    plain = _saved(t)
    item = _with_pickle(plain, _padded_location(_pickle_of(plain), MAX_PICKLE))
    fd = put(item)
    at = locate_tensor_data(fd, PAD, len(item), t.dtype, t.shape)
    assert at is not None
    assert os.pread(fd, t.nbytes, PAD + at) == t.numpy().tobytes()


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize("case", sorted(_TENSORS))
def test_a_member_ending_at_the_items_last_byte_is_read_in_place_one_byte_more_is_not(
    put: Any, case: str
) -> None:
    t = _TENSORS[case]
    plain = _saved(t)
    fd = put(plain)
    expected = locate_tensor_data(fd, PAD, len(plain), t.dtype, t.shape)
    assert expected is not None
    _, data_at = _data_member(plain)
    to_the_end = _with_member_size(plain, len(plain) - data_at)
    fd = put(to_the_end)
    assert locate_tensor_data(fd, PAD, len(to_the_end), t.dtype, t.shape) == expected
    past_the_end = _with_member_size(plain, len(plain) - data_at + 1)
    fd = put(past_the_end)
    assert locate_tensor_data(fd, PAD, len(past_the_end), t.dtype, t.shape) is None


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize("case", sorted(_TENSORS))
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_a_storage_larger_than_its_member_is_not_read_in_place(
    put: Any, case: str, extra: int
) -> None:
    """data.pkl says the storage has ``extra`` elements more than the member holds:
    the archive contradicts itself, and torch.load (which refuses it) decides."""
    t = _TENSORS[case]
    plain = _saved(t)
    item = _with_pickle(plain, _with_numel(_pickle_of(plain), t.numel() + extra))
    fd = put(item)
    at = locate_tensor_data(fd, PAD, len(item), t.dtype, t.shape)
    if extra == 0:
        assert at is not None
        assert os.pread(fd, t.nbytes, PAD + at) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    else:
        assert at is None
