"""The reference load planner (refdcp/reference/load_planner.py) used on its own: when nested
objects are placed (LOAD-19), and a stored layout that does not tile its tensor refused before
any read (RESHARD-5, FMT-28)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

import refdcp.reference
from refdcp.comm import SingleRank
from refdcp.errors import CheckpointError
from refdcp.reference import ReferenceReader
from refdcp.reference import format as fmt
from refdcp.reference.load_planner import ReferenceLoadPlanner, reads_for_chunk

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"


def _saved(tmp_path: Path, sd: dict[str, Any]) -> Any:
    refdcp.reference.save(sd, checkpoint_id=tmp_path, comm=SingleRank())
    return ReferenceReader(tmp_path).read_metadata()


def _read_objects(planner: ReferenceLoadPlanner, values: dict[str, Any]) -> None:
    for ri in planner.create_local_plan().items:
        if ri.type == LoadItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(values[ri.dest_index.fqn], buf)
            buf.seek(0)
            planner.load_bytes(ri, buf)


@pytest.mark.spec("LOAD-19", "REF-1")
@pytest.mark.parametrize("defer", [False, True])
def test_nested_objects_wait_for_the_apply_step_only_when_deferred(
    tmp_path: Path, defer: bool
) -> None:
    md = _saved(tmp_path, {"n": 1, "cfg": {"lr": 0.5}})
    sd: dict[str, Any] = {"n": 0, "cfg": {"lr": 0.0}}
    planner = ReferenceLoadPlanner()
    assert planner.defer_nested_values is False  # placed as read unless a driver defers
    planner.defer_nested_values = defer
    planner.set_up_planner(sd, md)
    _read_objects(planner, {"n": 1, "cfg.lr": 0.5})
    assert sd["n"] == 1  # a top-level value is placed as it is read, deferred or not
    assert sd["cfg"]["lr"] == (0.0 if defer else 0.5)
    planner.apply_loaded_values()
    assert sd == {"n": 1, "cfg": {"lr": 0.5}}


@pytest.mark.spec("RESHARD-5", "FMT-28", "REF-9")
def test_stored_chunks_that_overlap_are_refused_before_any_read(tmp_path: Path) -> None:
    md = _saved(tmp_path, {"w": torch.arange(4.0)})
    md.state_dict_metadata["w"].chunks.append(
        ChunkStorageMetadata(offsets=torch.Size([1]), sizes=torch.Size([2]))
    )
    (rec,) = md.storage_data.values()
    md.storage_data[MetadataIndex("w", torch.Size([1]))] = _StorageInfo(
        rec.relative_path, rec.offset + rec.length, 8
    )
    (tmp_path / ".metadata").write_bytes(fmt.dump_metadata(md))
    sd = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointError, match="do not tile"):
        refdcp.reference.load(sd, checkpoint_id=tmp_path, comm=SingleRank())
    assert torch.equal(sd["w"], torch.zeros(4))


def _c(off: tuple[int, ...], size: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(off), torch.Size(size))


@pytest.mark.spec("RESHARD-1", "RESHARD-3", "REF-4")
def test_one_read_per_saved_chunk_sharing_an_element_with_the_target() -> None:
    target = _c((2, 0), (2, 4))
    saved = [_c((0, 0), (0, 4)), _c((0, 0), (2, 4)), _c((2, 0), (2, 4)), _c((4, 0), (2, 4))]
    (read,) = reads_for_chunk("w", 0, target, saved)  # the empty and the touching ones: none
    assert read.storage_index.offset == torch.Size((2, 0))
    assert (read.dest_offsets, read.storage_offsets, read.lengths) == ((0, 0), (0, 0), (2, 4))
    assert reads_for_chunk("w", 0, _c((0, 0), (0, 4)), saved) == []
