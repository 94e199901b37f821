"""Checked reads straight into the destination (LOAD-10, INTEG-1; issue 13).

``read_checked_into`` fills the view with an item's data bytes and checks
one CRC-32C over the item's whole stored range (framing header, data, tail).
A flipped byte anywhere in that range, or a file cut short anywhere in it,
raises ``CorruptionError`` naming the item, the file and the offset; the
same through a default ``refdcp.load``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo

import refdcp
from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs.checked_read import PIECE_BYTES, read_checked_into
from refdcp.storage.metadata.safe import load_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BASE = 100  # the item starts this far into the file


def _item(head: int, data: bytes, tail: int) -> tuple[bytes, Any]:
    """File bytes (junk before BASE) and the item's ``_StorageInfo``."""
    stored = bytes((i * 31 + 5) % 256 for i in range(head)) + data + b"\xee" * tail
    info = _StorageInfo("x.distcp", BASE, len(stored))
    info.refdcp_crc32c = crc32c.crc32c(stored)  # type: ignore[attr-defined]
    info.refdcp_data_offset = head  # type: ignore[attr-defined]
    return b"J" * BASE + stored + b"after", info


@pytest.fixture
def open_file(tmp_path: Path) -> Iterator[Any]:
    fds: list[int] = []

    def make(content: bytes) -> int:
        p = tmp_path / f"f{len(fds)}"
        p.write_bytes(content)
        fds.append(os.open(p, os.O_RDONLY))
        return fds[-1]

    yield make
    for fd in fds:
        os.close(fd)


def _read(fd: int, n: int, info: Any) -> bytearray:
    out = bytearray(n)
    read_checked_into(fd, memoryview(out), info, "model.w", "ckpt/__0_0.distcp")
    return out


@pytest.mark.spec("LOAD-10", "LOAD-17")
@pytest.mark.parametrize(
    ("head", "size", "tail"),
    [
        (0, 0, 0),
        (0, 5, 0),
        (64, 5, 0),
        (64, 5, 22),
        (0, PIECE_BYTES, 0),
        (64, 2 * PIECE_BYTES + 3, 7),
    ],
)
def test_intact_items_land_whole(open_file: Any, head: int, size: int, tail: int) -> None:
    data = bytes((i * 7 + 1) % 251 for i in range(size))
    content, info = _item(head, data, tail)
    assert bytes(_read(open_file(content), size, info)) == data


def _corrupt_cases() -> list[tuple[int, int, int, int]]:
    # (head, size, tail, position inside the stored range)
    return [
        (64, 5, 0, 0),
        (64, 5, 0, 63),
        (64, 5, 0, 64),
        (64, 5, 0, 68),
        (64, 5, 22, 69),
        (64, 5, 22, 90),
        (0, 9, 0, 0),
        (0, 9, 0, 8),
        (16, PIECE_BYTES + 10, 4, 16 + PIECE_BYTES + 3),
        (16, PIECE_BYTES + 10, 4, 16 + PIECE_BYTES - 1),
    ]


@pytest.mark.spec("LOAD-10", "INTEG-1")
@pytest.mark.parametrize(("head", "size", "tail", "pos"), _corrupt_cases())
def test_a_flipped_byte_anywhere_in_the_stored_range_is_named(
    open_file: Any, head: int, size: int, tail: int, pos: int
) -> None:
    data = bytes((i * 13 + 3) % 256 for i in range(size))
    content, info = _item(head, data, tail)
    bad = bytearray(content)
    bad[BASE + pos] ^= 0x10
    with pytest.raises(CorruptionError, match="checksum mismatch") as err:
        _read(open_file(bytes(bad)), size, info)
    e = err.value
    assert (e.fqn, e.file, e.offset) == ("model.w", "ckpt/__0_0.distcp", BASE)
    assert f"stored {info.refdcp_crc32c:08x}" in str(e)


@pytest.mark.spec("LOAD-10")
@pytest.mark.parametrize(
    ("head", "size", "tail"), [(64, 5, 22), (0, 40, 0), (8, PIECE_BYTES + 9, 3)]
)
@pytest.mark.parametrize("cut", [0, 1, 7, 8, 9, 20, 63, 64, 65, 68, 69, 80, -1])
def test_a_file_cut_short_anywhere_in_the_item_is_named_at_the_cut(
    open_file: Any, head: int, size: int, tail: int, cut: int
) -> None:
    data = bytes(size)
    content, info = _item(head, data, tail)
    stored = head + size + tail
    if cut == -1:  # inside the second piece of a large item
        cut = head + PIECE_BYTES + 4 if size > PIECE_BYTES else stored - 1
    elif cut >= stored:
        cut = stored - 1 - (cut % 3)
    fd = open_file(content[: BASE + cut])
    with pytest.raises(CorruptionError, match="data file truncated") as err:
        _read(fd, size, info)
    e = err.value
    assert (e.fqn, e.file, e.offset) == ("model.w", "ckpt/__0_0.distcp", BASE + cut)


@pytest.mark.spec("LOAD-10")
def test_framing_that_does_not_fit_the_stated_length_is_refused(open_file: Any) -> None:
    content, info = _item(64, b"abcde", 0)
    with pytest.raises(CorruptionError, match="6 data bytes do not fit in 69") as err:
        _read(open_file(content + b"\0"), 6, info)
    assert err.value.offset == BASE


@pytest.mark.spec("LOAD-10")
@settings(max_examples=40, deadline=None)
@given(
    head=st.sampled_from([0, 1, 64]),
    data=st.binary(max_size=300),
    tail=st.integers(0, 30),
    flip=st.integers(0, 10_000),
    bit=st.integers(0, 7),
)
def test_property_exactly_the_damaged_items_fail(
    tmp_path_factory: pytest.TempPathFactory, head: int, data: bytes, tail: int, flip: int, bit: int
) -> None:
    content, info = _item(head, data, tail)
    p = tmp_path_factory.mktemp("chk") / "f"
    stored = head + len(data) + tail
    bad = bytearray(content)
    damaged = stored > 0
    if damaged:
        bad[BASE + flip % stored] ^= 1 << bit
    else:
        bad[0] ^= 1  # outside the item: harmless
    p.write_bytes(bytes(bad))
    fd = os.open(p, os.O_RDONLY)
    try:
        if damaged:
            with pytest.raises(CorruptionError) as err:
                _read(fd, len(data), info)
            assert err.value.fqn == "model.w" and err.value.offset == BASE
        else:
            assert bytes(_read(fd, len(data), info)) == data
    finally:
        os.close(fd)


# -- through a default refdcp.load (LOAD-10) -------------------------------------------


def _saved(tmp_path: Path) -> tuple[Path, Any, dict[str, torch.Tensor]]:
    sd = {"a": torch.arange(64, dtype=torch.float32), "b": torch.arange(300, dtype=torch.int64)}
    refdcp.save(sd, checkpoint_id=tmp_path)
    md = load_metadata((tmp_path / ".metadata").read_bytes())
    return tmp_path, md, sd


@pytest.mark.spec("LOAD-10")
@pytest.mark.parametrize("where", ["header", "data", "last"])
def test_a_default_load_names_the_damaged_item(tmp_path: Path, where: str) -> None:
    path, md, sd = _saved(tmp_path)
    info = next(i for k, i in md.storage_data.items() if k.fqn == "b")
    pos = {
        "header": info.offset + 3,
        "data": info.offset + info.refdcp_data_offset + 100,
        "last": info.offset + info.length - 1,
    }[where]
    f = path / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[pos] ^= 0x01
    f.write_bytes(bytes(raw))
    out = {"a": torch.zeros(64), "b": torch.zeros(300, dtype=torch.int64)}
    with pytest.raises(BaseException) as err:
        refdcp.load(out, checkpoint_id=path)
    text = repr(err.value)
    assert "checksum mismatch" in text, text
    assert f"fqn='b', file='{info.relative_path}', offset={info.offset})" in text, text
    out2 = {"a": torch.zeros(64)}
    refdcp.load(out2, checkpoint_id=path)  # the intact item still loads
    assert torch.equal(out2["a"], sd["a"])
