"""FileSystemReader's checks on crafted and damaged checkpoints, driven as torch's ``dcp.load``
drives a reader: a truncated file is refused before anything is allocated for its items, a
missing one is named from byte 0, a chunk's stated shape must fit its item to the byte, a
resharded read checks its saved chunk once, a damaged in-place read leaves zeros, every read
is committed, and the reader checks by default inside torch's own ``dcp.load`` (STORE-12,
STORE-28, LOAD-10, LOAD-17, LOAD-20, LOAD-22; issue 28's reader survivors).
"""

from __future__ import annotations

import contextlib
import io
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import refdcp
from refdcp.planning import DefaultLoadPlanner
from refdcp.storage import CorruptionError, FileSystemReader, FileSystemWriter
from refdcp.storage.format.items import CRC_ATTR, DATA_OFFSET_ATTR, INPLACE_MIN_BYTES
from refdcp.storage.fs import filesystem as fs
from refdcp.storage.metadata.safe import dump_metadata, load_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@contextlib.contextmanager
def _python_peak() -> Iterator[list[int]]:
    """The peak of Python allocations inside the block, above what was allocated before it
    (traced by ``tracemalloc``; an outer tracing session is left running)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = [0]
    try:
        yield out
    finally:
        out[0] = tracemalloc.get_traced_memory()[1] - base
        if started:
            tracemalloc.stop()


#: rows of 1,024 float32 (4 KiB each): 300 rows make an item above the in-place threshold
_ROW = 1024
_LARGE_ROWS = INPLACE_MIN_BYTES // (4 * _ROW) + 44


def _save(root: Path, sd: dict[str, Any]) -> None:
    refdcp.save(sd, storage_writer=FileSystemWriter(root, sync_files=False), no_dist=True)


def _records(root: Path) -> dict[str, Any]:
    md = load_metadata((root / ".metadata").read_bytes())
    assert md.storage_data is not None
    return {idx.fqn: info for idx, info in md.storage_data.items()}


def _reader(root: Path, verify: bool | None = None) -> FileSystemReader:
    reader = FileSystemReader(root)
    reader.set_verify(verify)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    return reader


def _read_all(reader: FileSystemReader, dest: dict[str, Any], root: Path) -> None:
    """One rank's load of ``dest`` through the reader, as torch's driver makes it."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, load_metadata((root / ".metadata").read_bytes()), True)
    reader.read_data(planner.create_local_plan(), planner).wait()


def _flip(root: Path, info: Any, at: int) -> None:
    path = root / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + at] ^= 0x5A
    path.write_bytes(bytes(data))


# -- STORE-28: a truncated data file is refused before anything is allocated for its items ------


@pytest.mark.spec("STORE-28", "STORE-13", "LOAD-10")
@pytest.mark.parametrize("kind", ["bytes", "tensor, verify=True", "tensor part"])
def test_an_item_past_the_end_of_its_file_is_refused_before_any_allocation(
    tmp_path: Path, kind: str
) -> None:
    """The data file ends inside a 6 MiB item: the reader names the item and the file's end
    without allocating a buffer for the item (no Python allocation near its size), whatever
    path the item would take (bytes, a checked tensor, part of a tensor)."""
    n = 6 << 20
    if kind == "bytes":
        sd: dict[str, Any] = {"x": io.BytesIO(bytes(range(256)) * (n // 256))}
    else:
        sd = {"x": torch.ones(n // (4 * _ROW), _ROW)}
    _save(tmp_path, sd)
    info = _records(tmp_path)["x"]
    size = info.offset + info.length // 2
    os.truncate(tmp_path / info.relative_path, size)
    reader = _reader(tmp_path, True if kind == "tensor, verify=True" else None)
    if kind == "tensor part":
        rows = n // (4 * _ROW)
        req = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("x", torch.Size([0, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex("x", torch.Size([0, 0]), 0),
            storage_offsets=torch.Size([rows - 2, 0]),
            lengths=torch.Size([2, _ROW]),
        )
        dest = torch.full((2, _ROW), 7.0)
        planner: Any = _Fixed({"x": dest})
        plan = LoadPlan([req])
    else:
        planner = DefaultLoadPlanner()
        dest_sd = {"x": io.BytesIO() if kind == "bytes" else torch.full_like(sd["x"], 7.0)}
        planner.set_up_planner(dest_sd, load_metadata((tmp_path / ".metadata").read_bytes()), True)
        plan = planner.create_local_plan()
    with (
        _python_peak() as peak_box,
        pytest.raises(CorruptionError, match="data file truncated") as err,
    ):
        reader.read_data(plan, planner)
    peak = peak_box[0]
    assert peak < 1 << 20, f"{peak} bytes allocated for an item that does not fit its file"
    assert (err.value.fqn, err.value.file, err.value.offset) == ("x", info.relative_path, size)
    assert f"item needs {info.offset + info.length}" in str(err.value)


class _Fixed:
    """A load planner that hands out fixed destinations by key and records the commits."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests = dests
        self.committed: list[str] = []

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dests[read_item.dest_index.fqn]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(read_item.dest_index.fqn)


# -- LOAD-22: a missing data file is named from its first byte ----------------------------------


@pytest.mark.spec("LOAD-22", "LOAD-10")
@pytest.mark.parametrize("transformed", [False, True])
def test_a_missing_data_file_is_damage_from_byte_zero(tmp_path: Path, transformed: bool) -> None:
    """With ``.metadata`` unchanged, a data file that is gone is damage: the error names the
    item, the file and offset 0 (every byte of it is missing), on the plain and the
    transformed read paths alike."""
    writer = FileSystemWriter(tmp_path, sync_files=False)
    if transformed:
        from refdcp.storage.fs import transforms

        pytest.importorskip("zstandard")
        writer = FileSystemWriter(tmp_path, sync_files=False, _extensions=[transforms.zstd()])
    refdcp.save({"w": torch.arange(6.0)}, storage_writer=writer, no_dist=True)
    info = _records(tmp_path)["w"]
    assert bool(getattr(info, "transform_descriptors", None)) == transformed
    (tmp_path / info.relative_path).unlink()
    with pytest.raises(CorruptionError, match="data file missing") as err:
        _read_all(_reader(tmp_path), {"w": torch.zeros(6)}, tmp_path)
    assert (err.value.fqn, err.value.file, err.value.offset) == ("w", info.relative_path, 0)


# -- STORE-28: a chunk's stated shape must fit its item, to the byte ----------------------------


def _restate(root: Path, fqn: str, numel: int, length_cut: int = 0) -> Any:
    """Rewrite ``.metadata`` so that 1-d tensor ``fqn`` has ``numel`` elements, its record
    ``length_cut`` bytes shorter and no checksum; returns the record."""
    md = load_metadata((root / ".metadata").read_bytes())
    tmd = md.state_dict_metadata[fqn]
    tmd.size = torch.Size([numel])  # type: ignore[union-attr]
    tmd.chunks[0].sizes = torch.Size([numel])  # type: ignore[union-attr]
    assert md.storage_data is not None
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    info.length -= length_cut
    delattr(info, CRC_ATTR)
    (root / ".metadata").write_bytes(dump_metadata(md))
    return info


@pytest.mark.spec("STORE-28")
@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.complex64])
def test_a_stated_shape_needing_more_bytes_than_the_item_holds_is_refused(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """The metadata states one element more than the item's length can hold after its data
    offset (elements x element size): refused by name, the destination untouched."""
    _save(tmp_path, {"w": torch.ones(4, dtype=dtype)})
    info = _records(tmp_path)["w"]
    room = info.length - getattr(info, DATA_OFFSET_ATTR)
    numel = room // dtype.itemsize + 1
    _restate(tmp_path, "w", numel)
    dest = torch.full((numel,), 3, dtype=dtype)
    with pytest.raises(CorruptionError, match=rf"chunk of shape \[{numel}\] needs") as err:
        _read_all(_reader(tmp_path), {"w": dest}, tmp_path)
    assert (err.value.fqn, err.value.file) == ("w", info.relative_path)
    assert bool((dest == 3).all())


@pytest.mark.spec("STORE-28", "STORE-47")
@pytest.mark.parametrize("cut", [0, 1])
def test_an_item_exactly_as_long_as_its_elements_need_is_read(tmp_path: Path, cut: int) -> None:
    """A record cut back to its data offset plus its elements (no bytes after them) still
    loads its values; one byte shorter is refused."""
    saved = torch.arange(5, dtype=torch.float64)
    _save(tmp_path, {"w": saved})
    info = _records(tmp_path)["w"]
    tail = info.length - getattr(info, DATA_OFFSET_ATTR) - saved.nbytes
    _restate(tmp_path, "w", 5, length_cut=tail + cut)
    dest = torch.zeros(5, dtype=torch.float64)
    if cut:
        with pytest.raises(CorruptionError, match=r"chunk of shape \[5\] needs"):
            _read_all(_reader(tmp_path), {"w": dest}, tmp_path)
        assert not dest.any()
    else:
        _read_all(_reader(tmp_path), {"w": dest}, tmp_path)
        assert torch.equal(dest, saved)


# -- LOAD-17: a resharded read checks its saved chunk once, whole ------------------------------


def _half(fqn: str, top: bool, rows: int, cols: int) -> ReadItem:
    first = 0 if top else rows // 2
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(f"{fqn}.{first}", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex(fqn, torch.Size([0, 0]), 0),
        storage_offsets=torch.Size([first, 0]),
        lengths=torch.Size([rows // 2, cols]),
    )


@pytest.mark.spec("LOAD-17", "LOAD-10", "STORE-16", "STORE-41")
@pytest.mark.parametrize("large", [False, True])
def test_two_parts_of_one_saved_chunk_check_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    """Default mode, two reads of halves of one saved chunk (small: through a checked whole
    read; large: through the streaming check): the chunk's CRC-32C is computed once, and
    each half gets its rows."""
    rows, cols = (_LARGE_ROWS, _ROW) if large else (6, 5)
    saved = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    _save(tmp_path, {"w": saved})
    checks: list[str] = []
    blob, stream = fs.verify_blob, fs.verify_streaming

    def counted_blob(*args: Any, **kwargs: Any) -> None:
        checks.append("blob")
        blob(*args, **kwargs)

    def counted_stream(*args: Any, **kwargs: Any) -> None:
        checks.append("stream")
        stream(*args, **kwargs)

    monkeypatch.setattr(fs, "verify_blob", counted_blob)
    monkeypatch.setattr(fs, "verify_streaming", counted_stream)
    top, bottom = torch.zeros(rows // 2, cols), torch.zeros(rows // 2, cols)
    planner = _Fixed({"w.0": top, f"w.{rows // 2}": bottom})
    reader = _reader(tmp_path)
    plan = LoadPlan([_half("w", True, rows, cols), _half("w", False, rows, cols)])
    reader.read_data(plan, planner).wait()  # type: ignore[arg-type]
    assert checks == ["stream" if large else "blob"]
    assert torch.equal(top, saved[: rows // 2]) and torch.equal(bottom, saved[rows // 2 :])


# -- LOAD-17, LOAD-20: a damaged in-place read leaves zeros; a scratch read leaves the old values


@pytest.mark.spec("LOAD-17", "LOAD-20")
@pytest.mark.parametrize("dest_kind", ["in place", "other dtype", "non-contiguous"])
def test_a_damaged_large_item_zero_fills_only_a_destination_read_in_place(
    tmp_path: Path, dest_kind: str
) -> None:
    """A large whole chunk with one flipped element byte, default mode: a contiguous CPU
    destination of the stored dtype and shape took the bytes as they landed, so it is
    zero-filled; a destination read through a scratch tensor keeps its old values."""
    saved = torch.arange(_LARGE_ROWS * _ROW, dtype=torch.float32).reshape(_LARGE_ROWS, _ROW)
    _save(tmp_path, {"w": saved})
    info = _records(tmp_path)["w"]
    _flip(tmp_path, info, getattr(info, DATA_OFFSET_ATTR) + saved.nbytes // 2)
    dest = {
        "in place": torch.full_like(saved, 7.0),
        "other dtype": torch.full(saved.shape, 7.0, dtype=torch.float64),
        "non-contiguous": torch.full((_ROW, _LARGE_ROWS), 7.0).t(),
    }[dest_kind]
    planner = _Fixed({"w": dest})
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", torch.Size([0, 0]), 0),
        storage_offsets=torch.Size([0, 0]),
        lengths=saved.shape,
    )
    with pytest.raises(CorruptionError, match="checksum mismatch") as err:
        _reader(tmp_path).read_data(LoadPlan([req]), planner)  # type: ignore[arg-type]
    assert err.value.fqn == "w" and err.value.overwritten == ()
    if dest_kind == "in place":
        assert not dest.any()
    else:
        assert bool((dest == 7).all())
    assert planner.committed == []


# -- STORE-12: every large read is committed to the planner ------------------------------------


class _Staged(DefaultLoadPlanner):
    """Hands the reader a staging tensor and moves it into the state dict on commit (a
    planner may; STORE-12 makes the commit the moment the item is delivered)."""

    def __init__(self, dest: dict[str, torch.Tensor], staging_dtype: torch.dtype) -> None:
        super().__init__()
        self.dest = dest
        self.staging_dtype = staging_dtype
        self.staged: dict[str, torch.Tensor] = {}

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = super().resolve_tensor(read_item)
        staged = torch.empty(dest.shape, dtype=self.staging_dtype)
        self.staged[read_item.dest_index.fqn] = staged
        return staged

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        self.dest[fqn].copy_(self.staged.pop(fqn))


@pytest.mark.spec("STORE-12", "LOAD-10")
@pytest.mark.parametrize("staging", [torch.float32, torch.float64])
@pytest.mark.parametrize("verify", [None, False])
def test_a_large_item_reaches_the_state_dict_only_through_commit_tensor(
    tmp_path: Path, staging: torch.dtype, verify: bool | None
) -> None:
    """Large whole chunks read into the planner's staging tensor (in place when it has the
    stored dtype, through a scratch tensor when not): the values reach the state dict because
    the reader commits each one."""
    saved = {
        k: torch.arange(_LARGE_ROWS * _ROW, dtype=torch.float32).reshape(_LARGE_ROWS, _ROW) + i
        for i, k in enumerate(("a", "b"))
    }
    _save(tmp_path, saved)
    dest = {k: torch.zeros_like(v) for k, v in saved.items()}
    planner = _Staged(dest, staging)
    planner.set_up_planner(dest, load_metadata((tmp_path / ".metadata").read_bytes()), True)
    _reader(tmp_path, verify).read_data(planner.create_local_plan(), planner).wait()
    assert planner.staged == {}
    assert all(torch.equal(dest[k], v) for k, v in saved.items())


# -- LOAD-10, LOAD-20: refdcp's reader checks by default inside torch's own dcp.load -----------


@pytest.mark.spec("LOAD-10", "LOAD-20")
@pytest.mark.parametrize("large", [False, True])
def test_torchs_load_with_refdcps_reader_checks_every_item(tmp_path: Path, large: bool) -> None:
    """torch's ``dcp.load`` never calls ``set_verify``: refdcp's reader still checks each
    item's CRC-32C, so a flipped element byte fails the load instead of loading."""
    rows = _LARGE_ROWS if large else 4
    saved = torch.arange(rows * _ROW, dtype=torch.float32).reshape(rows, _ROW)
    _save(tmp_path, {"w": saved})
    info = _records(tmp_path)["w"]
    _flip(tmp_path, info, getattr(info, DATA_OFFSET_ATTR) + 8)
    dest = torch.full_like(saved, 7.0)
    with pytest.raises(CheckpointException, match=r"checksum mismatch .*\(fqn='w'"):
        dcp.load({"w": dest}, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert not dest.any()  # zero-filled, no byte of the damaged item kept (LOAD-20)
