"""The small-item load path: runs of adjacent items, one-pass metadata check, no cycles
(STORE-47, STORE-48, LOAD-11, RESHARD-1)."""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

import refdcp
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultLoadPlanner
from refdcp.planning.resharding import read_items_for_chunks, whole_tensor_read
from refdcp.storage import CorruptionError, FileSystemReader, FileSystemWriter
from refdcp.storage.errors import MalformedMetadataError, UnsafeMetadataError
from refdcp.storage.fs.metadata_file import read_metadata_file
from refdcp.storage.fs.small_reads import SmallItem, read_small_items
from refdcp.storage.metadata.bulk import entries_ok, records_ok
from refdcp.storage.metadata.limits import get_metadata_limits
from refdcp.storage.metadata.safe import load_metadata, safe_loads
from refdcp.storage.metadata.shape import check_metadata

SINGLE_PATH = (
    "the fast FileSystemReader's batched reads of adjacent small items and its metadata pass"
)


def _state(n: int = 24, elems: int = 64) -> dict[str, torch.Tensor]:
    return {f"m.p{i}": torch.arange(elems, dtype=torch.float32) + 1000 * i for i in range(n)}


def _save(path: Path, state: dict[str, Any]) -> None:
    refdcp.save(state, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _info(path: Path, fqn: str) -> Any:
    md = load_metadata(read_metadata_file(path / ".metadata"))
    assert md.storage_data is not None
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def _root_error(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointError):
        return next(iter(exc.rank_failures.values())).exception
    return exc


@pytest.mark.spec("STORE-47")
def test_adjacent_small_items_share_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    _save(tmp_path, state)
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    dest = _zeros(state)
    refdcp.load(dest, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert calls == [2 * len(state) + 1]  # the framing spans between the elements, one read


@pytest.mark.spec("STORE-47", "LOAD-10", "STORE-54")
@pytest.mark.parametrize("where", ["elements", "framing"])
def test_a_damaged_item_inside_a_run_is_named(tmp_path: Path, where: str) -> None:
    state = _state()
    _save(tmp_path, state)
    info = _info(tmp_path, "m.p11")
    pos = info.offset + (info.refdcp_data_offset + 8 if where == "elements" else 30)
    with open(tmp_path / info.relative_path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    dest = _zeros(state)
    with pytest.raises(Exception) as err:
        refdcp.load(dest, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    exc = _root_error(err.value)
    assert isinstance(exc, CorruptionError)
    assert (exc.fqn, exc.file, exc.offset) == ("m.p11", info.relative_path, info.offset)
    assert torch.equal(dest["m.p10"], state["m.p10"])  # items before it were delivered
    # a later item of the same run holds nothing or its own checkpoint values, never others'
    assert not dest["m.p12"].any() or torch.equal(dest["m.p12"], state["m.p12"])


@pytest.mark.spec("STORE-47")
def test_a_short_read_names_the_first_item_not_read(tmp_path: Path) -> None:
    state = _state(4)
    _save(tmp_path, state)
    infos = [_info(tmp_path, k) for k in state]
    os.truncate(tmp_path / infos[0].relative_path, infos[2].offset + 10)  # after the size check
    planner = DefaultLoadPlanner()
    md = load_metadata(read_metadata_file(tmp_path / ".metadata"))
    dest = _zeros(state)
    planner.set_up_planner(dest, md, True)
    reads = {r.storage_index.fqn: r for r in planner.create_local_plan().items}
    items = [
        SmallItem(
            reads[k],
            i.offset,
            i.length,
            i.refdcp_data_offset,
            torch.float32,
            (64,),
            i.refdcp_crc32c,
        )
        for k, i in zip(state, infos)
    ]
    fd = os.open(tmp_path / infos[0].relative_path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptionError, match="truncated") as err:
            read_small_items(fd, infos[0].relative_path, items, planner, batch=True)
    finally:
        os.close(fd)
    assert err.value.fqn == "m.p2" and err.value.offset == infos[2].offset + 10


class _ScratchPlanner(DefaultLoadPlanner):
    """Hands out one reused buffer and copies it into the state dict on commit."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.scratch: torch.Tensor | None = None

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self.events.append("resolve")
        target = super().resolve_tensor(read_item)
        if self.scratch is None or self.scratch.shape != target.shape:
            self.scratch = torch.empty_like(target)
        return self.scratch

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.events.append("commit")
        super().resolve_tensor(read_item).copy_(tensor)


@pytest.mark.spec("STORE-47", "STORE-12", "STORE-54")
def test_a_custom_planner_gets_one_item_at_a_time(tmp_path: Path) -> None:
    state = _state(8)
    _save(tmp_path, state)
    dest = _zeros(state)
    planner = _ScratchPlanner()
    refdcp.load(dest, storage_reader=FileSystemReader(tmp_path), planner=planner, no_dist=True)
    assert planner.events == ["resolve", "commit"] * len(state)
    assert all(torch.equal(dest[k], v) for k, v in state.items())


@pytest.mark.spec("STORE-47", "STORE-54")
def test_destinations_that_overlap_in_memory_are_read_one_at_a_time(tmp_path: Path) -> None:
    state = {"a": torch.ones(16), "b": torch.full((16,), 2.0)}
    _save(tmp_path, state)
    tied = torch.zeros(16)
    dest = {"a": tied, "b": tied}  # tied weights: one tensor under two keys
    refdcp.load(dest, storage_reader=FileSystemReader(tmp_path), no_dist=True)  # no false alarm
    assert torch.equal(tied, state["b"])  # file order: the later item wins, as one by one


@pytest.mark.spec("STORE-47", "POLICY-5")
def test_a_cast_destination_in_a_run_gets_a_copy(tmp_path: Path) -> None:
    state = _state(6)
    _save(tmp_path, state)
    dest = {k: torch.zeros(64, dtype=torch.float64) for k in state}
    dest["m.p3"] = torch.zeros(64)  # one in-place destination among cast ones
    refdcp.load(
        dest,
        storage_reader=FileSystemReader(tmp_path),
        planner=DefaultLoadPlanner(allow_cast=True),
        no_dist=True,
    )
    assert all(torch.equal(dest[k], v.to(dest[k].dtype)) for k, v in state.items())


# -- STORE-48: the one-pass metadata check accepts exactly what the per-item checks accept ---


def _metadata(shared: bool) -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([4, 2])
    zeros = torch.Size([0, 0])
    sdm: dict[str, Any] = {"obj": BytesStorageMetadata()}
    storage: dict[Any, Any] = {MetadataIndex("obj"): _StorageInfo("__0_0.distcp", 0, 10)}
    offset = 10
    for i in range(3):
        p = props if shared else TensorProperties(dtype=torch.float32)
        s = size if shared else torch.Size([4, 2])
        chunks = [
            ChunkStorageMetadata(zeros if shared else torch.Size([0, 0]), torch.Size([2, 2])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2])),
        ]
        sdm[f"t{i}"] = TensorStorageMetadata(p, s, chunks)
        for c in chunks:
            info = _StorageInfo("__0_0.distcp", offset, 100)
            info.refdcp_crc32c = 12345  # type: ignore[attr-defined]
            info.refdcp_data_offset = 64  # type: ignore[attr-defined]
            storage[MetadataIndex(f"t{i}", c.offsets, i)] = info
            offset += 100
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def _chunk0(md: Metadata) -> ChunkStorageMetadata:
    entry = md.state_dict_metadata["t1"]
    assert isinstance(entry, TensorStorageMetadata)
    return entry.chunks[0]


def _info0(md: Metadata) -> Any:
    assert md.storage_data is not None
    return list(md.storage_data.values())[2]


def _key0(md: Metadata) -> Any:
    assert md.storage_data is not None
    return list(md.storage_data)[2]


_BREAKS: dict[str, Any] = {
    "fqn not str": lambda md: md.state_dict_metadata.__setitem__(3, BytesStorageMetadata()),
    "entry kind": lambda md: md.state_dict_metadata.__setitem__("x", 5),
    "negative size": lambda md: setattr(md.state_dict_metadata["t1"], "size", torch.Size([-1, 2])),
    "size a list": lambda md: setattr(md.state_dict_metadata["t1"], "size", [4, 2]),
    "chunks a tuple": lambda md: setattr(md.state_dict_metadata["t1"], "chunks", ()),
    "chunk past end": lambda md: setattr(_chunk0(md), "sizes", torch.Size([5, 2])),
    "chunk rank": lambda md: setattr(_chunk0(md), "offsets", torch.Size([0])),
    "chunk offsets list": lambda md: setattr(_chunk0(md), "offsets", [0, 0]),
    "chunk negative": lambda md: setattr(_chunk0(md), "offsets", torch.Size([-1, 0])),
    "props dtype": lambda md: setattr(md.state_dict_metadata["t1"].properties, "dtype", "float32"),
    "props kind": lambda md: setattr(md.state_dict_metadata["t1"], "properties", {}),
    "chunk kind": lambda md: md.state_dict_metadata["t1"].chunks.append((0, 0)),
    "record name": lambda md: setattr(_info0(md), "relative_path", "../x"),
    "record name type": lambda md: setattr(_info0(md), "relative_path", 3),
    "record offset": lambda md: setattr(_info0(md), "offset", -1),
    "record length bool": lambda md: setattr(_info0(md), "length", True),
    "record crc": lambda md: setattr(_info0(md), "refdcp_crc32c", 1 << 32),
    "record data offset": lambda md: setattr(_info0(md), "refdcp_data_offset", 101),
    "record transform": lambda md: setattr(_info0(md), "transform_descriptors", [3]),
    "key index": lambda md: object.__setattr__(_key0(md), "index", -2),
    "key offset": lambda md: object.__setattr__(_key0(md), "offset", (0, 0)),
    "key fqn": lambda md: object.__setattr__(_key0(md), "fqn", None),
    "missing field": lambda md: delattr(md.state_dict_metadata["t1"], "chunks"),
}


@pytest.mark.spec("STORE-48", "FMT-9")
@pytest.mark.parametrize("shared", [True, False])
def test_the_one_pass_check_accepts_good_metadata(shared: bool) -> None:
    md = _metadata(shared)
    assert md.storage_data is not None
    cap = get_metadata_limits().max_string_chars
    assert entries_ok(md.state_dict_metadata, cap) and records_ok(md.storage_data, cap)
    check_metadata(md, file="m", limits=get_metadata_limits())


@pytest.mark.spec("STORE-48", "FMT-9", "STORE-26")
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("name", sorted(_BREAKS))
def test_the_one_pass_check_leaves_every_fault_to_the_per_item_check(
    name: str, shared: bool
) -> None:
    md = _metadata(shared)
    _BREAKS[name](md)
    assert md.storage_data is not None
    cap = get_metadata_limits().max_string_chars
    assert not (entries_ok(md.state_dict_metadata, cap) and records_ok(md.storage_data, cap))
    with pytest.raises((MalformedMetadataError, UnsafeMetadataError)):
        check_metadata(md, file="m", limits=get_metadata_limits())


@pytest.mark.spec("STORE-48")
def test_the_one_pass_check_refuses_a_long_name() -> None:
    md = _metadata(True)
    md.state_dict_metadata["x" * 50] = BytesStorageMetadata()
    assert not entries_ok(md.state_dict_metadata, 40)
    assert entries_ok(md.state_dict_metadata, 50)


# -- LOAD-11: nothing of a load left to the cyclic collector ------------------------------


@pytest.mark.spec("LOAD-11")
def test_unpickled_metadata_is_freed_by_reference_counting(tmp_path: Path) -> None:
    _save(tmp_path, _state(4))
    body = read_metadata_file(tmp_path / ".metadata")
    was = gc.isenabled()
    gc.disable()
    try:
        md = safe_loads(body[: body.rindex(b"#refdcp-crc32c:")])
        alive = weakref.ref(md)
        del md
        assert alive() is None
    finally:
        if was:
            gc.enable()


@pytest.mark.spec("LOAD-11", "API-20")
def test_a_load_leaves_no_metadata_for_the_collector(tmp_path: Path) -> None:
    state = _state(8)
    _save(tmp_path, state)
    dest = _zeros(state)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        kinds = (Metadata, TensorStorageMetadata)
        # what other tests of this process still hold is not this load's
        before = {id(o) for o in gc.get_objects() if type(o) in kinds}
        refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)
        left = [o for o in gc.get_objects() if type(o) in kinds and id(o) not in before]
        assert left == []
    finally:
        if was:
            gc.enable()
    assert all(torch.equal(dest[k], v) for k, v in state.items())


# -- RESHARD-1: the whole-tensor read is the sweep's read -----------------------------------


@pytest.mark.spec("RESHARD-1", "RESHARD-5")
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3))
def test_the_whole_tensor_read_is_the_sweeps_read(shape: list[int]) -> None:
    size = torch.Size(shape)
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        size,
        [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)],
    )
    target = ChunkStorageMetadata(torch.Size([0] * len(shape)), size)
    fast = whole_tensor_read("w", md)
    if fast is None:
        assert len(shape) == 0 or 0 in shape
        return
    (sweep,) = read_items_for_chunks("w", md, [target])
    assert dataclasses.astuple(fast) == dataclasses.astuple(sweep)
    assert (fast.dest_index.index, fast.storage_index.index) == (0, 0)


@pytest.mark.spec("RESHARD-1")
def test_the_whole_tensor_read_declines_other_layouts() -> None:
    size = torch.Size([4])
    two = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        size,
        [
            ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
            ChunkStorageMetadata(torch.Size([2]), torch.Size([2])),
        ],
    )
    part = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        size,
        [ChunkStorageMetadata(torch.Size([1]), torch.Size([3]))],
    )
    assert whole_tensor_read("w", two) is None
    assert whole_tensor_read("w", part) is None
    assert whole_tensor_read("w", BytesStorageMetadata()) is None
