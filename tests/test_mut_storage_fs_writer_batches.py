"""The data-file writer's batches and its writeback hint, seen from outside (STORE-50,
STORE-60, FMT-2, FMT-3; issue 28).

``_FileOut`` gathers small items into batches, written once they reach 4 MiB (or 512
parts), and hands the written bytes to the kernel's writeback (``sync_file_range``) once
at least 4 MiB of them are not handed yet. These tests save through
``refdcp.save`` with a recorder in place of ``start_writeback`` (or of the C library's
call) and check what every hint covers against the items' recorded offsets and the bytes
in the file: a hint covers written bytes only, contiguously from the start of the file,
and is made as soon as a batch reaches 4 MiB, also when ``os.writev`` writes less than it
was given and when a large part is written on its own.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import WriteItemType

import refdcp
from refdcp.planning import DefaultSavePlanner
from refdcp.storage import FileSystemReader, FileSystemWriter
from refdcp.storage.format.small_tensors import small_tensor_parts
from refdcp.storage.fs import filesystem as fs_module
from refdcp.storage.metadata.safe import load_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MIB = 1 << 20


class _RawBytes(DefaultSavePlanner):
    """Hands the writer each BYTE_IO value's own bytes, so its stored length is exactly
    the length chosen; with ``fresh``, every tensor item as a new copy that nothing else
    references (the writer alone keeps it alive until its bytes are written)."""

    def __init__(self, sd: dict[str, Any], fresh: bool = False) -> None:
        super().__init__()
        self._raw = sd
        self._fresh = fresh

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return self._raw[write_item.index.fqn]
        data = super().resolve_data(write_item)
        return data.clone() if self._fresh else data


def _hints(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(offset, nbytes, the file's size at the call) of each writeback hint."""
    calls: list[tuple[int, int, int]] = []

    def record(fd: int, offset: int, nbytes: int) -> None:
        calls.append((offset, nbytes, os.fstat(fd).st_size))

    monkeypatch.setattr(fs_module, "start_writeback", record)
    return calls


def _items(root: Path) -> tuple[Path, dict[str, tuple[int, int]]]:
    """The one data file and each item's (offset, length) in it."""
    md = load_metadata((root / ".metadata").read_bytes())
    assert md.storage_data is not None
    files = {info.relative_path for info in md.storage_data.values()}
    assert len(files) == 1
    items = {k.fqn: (i.offset, i.length) for k, i in md.storage_data.items()}
    return root / files.pop(), items


def _check_hints(
    calls: list[tuple[int, int, int]], size: int, ends: list[int], *, as_soon: bool
) -> None:
    """Each hint starts where the previous one ended (the first at 0), covers at least
    4 MiB of bytes already in the file, and ends at an item's end; under 4 MiB are left
    unhanded at the end. With ``as_soon``: a hint without its last item would be under
    4 MiB (the batch was handed as soon as it reached 4 MiB)."""
    handed = 0
    for offset, nbytes, at_call in calls:
        assert offset == handed
        assert nbytes >= 4 * MIB
        assert offset + nbytes <= at_call
        end = offset + nbytes
        assert end in ends
        if as_soon:
            before = max([e for e in ends if e < end], default=0)
            assert before - offset < 4 * MIB, (offset, nbytes, before)
        handed = end
    assert size - handed < 4 * MIB, (size, handed)


def _short_writev(seed: int) -> Any:
    """An ``os.writev`` that writes a random non-empty prefix of what it is given."""
    rnd = random.Random(seed)

    def short(fd: int, buffers: Any) -> int:
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        if not data:
            return 0
        return os.write(fd, data[: rnd.randint(1, len(data))])

    return short


# -- STORE-60: every hint, with short writes and large parts written on their own ---------


@pytest.mark.spec("STORE-60")
@pytest.mark.parametrize("big", [0, 5 * MIB])
@pytest.mark.parametrize("short", [False, True])
def test_hints_cover_exactly_the_bytes_written_whatever_writev_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, big: int, short: bool
) -> None:
    """9 MiB of small tensors after a BYTE_IO item of ``big`` bytes (5 MiB: written on its
    own, not gathered): the hints account for every byte written, the large part's and
    those of batches that ``os.writev`` wrote in several calls, so they are contiguous,
    within the file, and leave under 4 MiB unhanded at the end."""
    calls = _hints(monkeypatch)
    sd: dict[str, Any] = {
        f"t{i:02d}": torch.full((1 << 16,), i, dtype=torch.float32) for i in range(36)
    }
    if big:
        sd["blob"] = io.BytesIO(bytes(range(251)) * (big // 251 + 1))
    if short:
        monkeypatch.setattr(os, "writev", _short_writev(len(sd)))
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path), planner=_RawBytes(sd), no_dist=True)
    monkeypatch.undo()
    file, items = _items(tmp_path)
    ends = sorted(o + n for o, n in items.values())
    # a large part is handed with the batch after it: "as soon as" holds for batches only
    _check_hints(calls, file.stat().st_size, ends, as_soon=not big)
    assert len(calls) >= 2
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    refdcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


@pytest.mark.spec("STORE-60")
@pytest.mark.parametrize("per_batch", [2, 5])
def test_a_batch_reaching_exactly_4_mib_is_written_and_handed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_batch: int
) -> None:
    """A BYTE_IO item longer than any tensor item, then small tensors whose framed lengths
    bring the gathered bytes to exactly 4 MiB after ``per_batch`` of them: that batch is
    written and handed then, not one item later."""
    calls = _hints(monkeypatch)
    t = torch.arange(1 << 16, dtype=torch.float32)
    parts = small_tensor_parts(t)
    assert parts is not None
    framed = parts[3]
    lead = 4 * MIB - per_batch * framed
    assert framed < lead < 4 * MIB
    sd: dict[str, Any] = {"blob": io.BytesIO(bytes([7]) * lead)}
    sd.update({f"t{i:02d}": t + i for i in range(3 * per_batch)})
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path), planner=_RawBytes(sd), no_dist=True)
    file, items = _items(tmp_path)
    assert items["blob"] == (0, lead)
    ends = sorted(o + n for o, n in items.values())
    assert 4 * MIB in ends
    _check_hints(calls, file.stat().st_size, ends, as_soon=True)
    assert calls[0][:2] == (0, 4 * MIB)


@pytest.mark.spec("STORE-60")
@pytest.mark.parametrize("count", [1, 400])
def test_small_tensors_after_an_almost_full_batch_are_written_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """A BYTE_IO item one byte short of 4 MiB is gathered, not written; the first small
    tensor after it completes the batch, which is written and handed at once, and every
    later batch stays within what one ``writev`` takes (400 tensors: 1,200 parts)."""
    calls = _hints(monkeypatch)
    lead = 4 * MIB - 1
    sd: dict[str, Any] = {"blob": io.BytesIO(bytes([3]) * lead)}
    sd.update({f"t{i:03d}": torch.full((4,), i, dtype=torch.int32) for i in range(count)})
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path), planner=_RawBytes(sd), no_dist=True)
    file, items = _items(tmp_path)
    ends = sorted(o + n for o, n in items.values())
    _check_hints(calls, file.stat().st_size, ends, as_soon=True)
    first = min(o + n for k, (o, n) in items.items() if k != "blob")
    assert calls[0][:2] == (0, first)
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    refdcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


# -- STORE-60: the hint itself --------------------------------------------------------------


@pytest.mark.spec("STORE-60")
@settings(max_examples=30, deadline=None)
@given(offset=st.integers(0, 1 << 40), nbytes=st.integers(-3, 1 << 34))
@example(offset=0, nbytes=0)
@example(offset=4096, nbytes=1)
def test_the_hint_asks_for_exactly_the_range_given_and_never_for_an_empty_one(
    offset: int, nbytes: int
) -> None:
    """``start_writeback`` makes one SYNC_FILE_RANGE_WRITE call for the range it is given,
    and none for an empty range (for the kernel, a length of 0 means "to the end of the
    file", far more than was asked)."""
    calls: list[tuple[int, int, int, int]] = []

    def fake(fd: int, off: int, n: int, flags: int) -> int:
        calls.append((fd, off, n, flags))
        return 0

    mp = pytest.MonkeyPatch()
    mp.setattr(fs_module, "_SYNC_FILE_RANGE", fake)
    try:
        fs_module.start_writeback(9, offset, nbytes)
    finally:
        mp.undo()
    assert calls == ([(9, offset, nbytes, 2)] if nbytes > 0 else [])


@pytest.mark.spec("STORE-60")
def test_the_c_library_call_is_found_and_starts_writeback_of_a_range(tmp_path: Path) -> None:
    """On Linux (refdcp's platform) the C library has ``sync_file_range``: the lookup gives
    a call that accepts a written range of a file (returns 0), and a failing call (no such
    descriptor) only returns -1."""
    call = fs_module._libc_sync_file_range()
    assert call is not None
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"x" * 65536)
        assert call(fd, 0, 65536, fs_module._SYNC_FILE_RANGE_WRITE) == 0
        assert call(fd, 4096, 4096, fs_module._SYNC_FILE_RANGE_WRITE) == 0
    finally:
        os.close(fd)
    assert call(-1, 0, 1, fs_module._SYNC_FILE_RANGE_WRITE) == -1  # no such descriptor
    assert (tmp_path / "f").read_bytes() == b"x" * 65536


# -- STORE-50 / FMT-2: parts of one byte are written like any other ------------------------


@pytest.mark.spec("STORE-50", "FMT-2")
@settings(max_examples=12, deadline=None)
@given(lead=st.integers(1, 200))
@example(lead=1)
@example(lead=63)
@example(lead=127)
def test_one_byte_items_and_one_byte_pads_reach_the_file(
    tmp_path_factory: pytest.TempPathFactory, lead: int
) -> None:
    """A BYTE_IO item of ``lead`` bytes (one byte included) and then a 1 MiB tensor: the
    item's bytes are in the file at its recorded offset, verbatim, and the tensor starts
    64-byte aligned after zero bytes (a pad of one byte when ``lead`` is 63 modulo 64)."""
    root = tmp_path_factory.mktemp("lead")
    raw = bytes((i * 7 + 1) % 256 for i in range(lead))
    big = torch.arange(MIB // 4, dtype=torch.float32)
    sd: dict[str, Any] = {"b": io.BytesIO(raw), "t": big}
    writer = FileSystemWriter(root, sync_files=False)
    refdcp.save(sd, storage_writer=writer, planner=_RawBytes(sd), no_dist=True)
    file, items = _items(root)
    data = file.read_bytes()
    assert items["b"] == (0, lead)
    assert data[:lead] == raw
    offset, _ = items["t"]
    assert offset % 64 == 0 and 0 <= offset - lead < 64
    assert data[lead:offset] == bytes(offset - lead)
    out = {"t": torch.zeros_like(big)}
    refdcp.load(out, storage_reader=FileSystemReader(root), no_dist=True, verify=True)
    assert torch.equal(out["t"], big)


# -- the memory of a gathered small item stays alive until it is written --------------------


@pytest.mark.spec("STORE-60", "FMT-3")
def test_small_items_resolved_to_copies_are_stored_as_they_were(tmp_path: Path) -> None:
    """A planner that resolves every tensor to a fresh copy, referenced by nothing else:
    the writer keeps each copy alive until the batch holding its bytes is written, so the
    file holds every value (a freed copy's memory would hold a later item's)."""
    sd: dict[str, Any] = {
        f"t{i:03d}": torch.full((16,), i, dtype=torch.float32) for i in range(200)
    }
    refdcp.save(
        sd,
        storage_writer=FileSystemWriter(tmp_path),
        planner=_RawBytes(sd, fresh=True),
        no_dist=True,
    )
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    refdcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True, verify=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
