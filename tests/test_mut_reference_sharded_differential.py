"""The reference planners against the default ones on sharded values and on the refusals no
round trip reaches (REF-3, REF-4): the same write and read items for DTensors inside and
outside their mesh and for a ShardedTensor, the same chunk tensors, the same refusals, the
same read-once readers (ONCE-8).

The values are built as in ``test_mut_reference_sharded.py`` (which checks the reference
alone): meshes without a process group, and a one-rank Gloo group in this process for the
ShardedTensor.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner, LoadPolicyError
from refdcp.planning.read_once import assign_readers
from refdcp.reference import ReferenceReader
from refdcp.reference.load_planner import ReferenceLoadPlanner, read_once_readers
from refdcp.reference.save_planner import ReferenceSavePlanner
from refdcp.storage.errors import UnsafeObjectError

from .test_mut_reference_sharded import (
    _OddChunks,
    _one_chunk_md,
    _Opaque,
    dtensor,
    one_rank_group,
    partial_dtensor,
    sharded,
)

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"

__all__ = ["one_rank_group"]  # the fixture, used by name


def _writes(planner: Any, sd: dict[str, Any]) -> list[tuple[Any, ...]]:
    planner.set_up_planner(sd, None, True)
    return [
        (
            i.index.fqn,
            tuple(i.index.offset or ()),
            i.type,
            None if i.tensor_data is None else tuple(i.tensor_data.chunk.sizes),
        )
        for i in planner.create_local_plan().items
    ]


def _reads(planner: Any, sd: dict[str, Any], md: Metadata) -> list[tuple[Any, ...]]:
    planner.set_up_planner(sd, md, True)
    return [
        (r.dest_index.fqn, tuple(r.storage_index.offset or ()), tuple(r.lengths))
        for r in planner.create_local_plan().items
    ]


def _save_md(tmp_path: Path, sd: dict[str, Any]) -> Metadata:
    refdcp.reference.save(sd, checkpoint_id=tmp_path, comm=SingleRank())
    return ReferenceReader(tmp_path).read_metadata()


@pytest.mark.spec("REF-4", "REF-3", "PLAN-2")
def test_dtensor_writes_and_reads_equal_the_default_planners(tmp_path: Path) -> None:
    inside = dtensor(torch.ones(3, 2), (3, 2), [0], 0)
    outside = dtensor(torch.ones(0, 2), (3, 2), [1], 0)
    for sd in ({"d": inside}, {"d": outside}):
        ref = _writes(ReferenceSavePlanner(), sd)
        assert ref == _writes(DefaultSavePlanner(), sd)
        assert len(ref) == (1 if sd["d"] is inside else 0)
    md = _save_md(tmp_path, {"d": torch.zeros(3, 2)})
    for sd in ({"d": inside}, {"d": outside}):
        ref = _reads(ReferenceLoadPlanner(), sd, md)
        assert ref == _reads(DefaultLoadPlanner(), sd, md)
        assert len(ref) == (1 if sd["d"] is inside else 0)
    for planner in (ReferenceSavePlanner(), DefaultSavePlanner()):
        planner.set_up_planner({"p": partial_dtensor()}, None, True)
        with pytest.raises(ValueError, match="'p' is a DTensor with a Partial placement"):
            planner.create_local_plan()


@pytest.mark.spec("REF-4", "REF-3", "PLAN-1", "PLAN-6")
@pytest.mark.usefixtures("one_rank_group")
def test_sharded_tensor_writes_reads_and_chunks_equal_the_default_planners(
    tmp_path: Path,
) -> None:
    """The default planner takes one local shard per ShardedTensor: one holding a single
    element, one holding three."""
    sd = {"one": sharded([(0, 1)], width=1), "three": sharded([(0, 3)], width=1)}
    ref_w = _writes(ReferenceSavePlanner(), sd)
    assert ref_w == _writes(DefaultSavePlanner(), sd) and len(ref_w) == 2
    ref_p, fast_p = ReferenceSavePlanner(), DefaultSavePlanner()
    for p in (ref_p, fast_p):
        p.set_up_planner(sd, None, True)
    for a, b in zip(ref_p.create_local_plan().items, fast_p.create_local_plan().items, strict=True):
        ta, tb = ref_p.resolve_data(a), fast_p.resolve_data(b)
        assert isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)
        assert torch.equal(ta, tb) and ta.numel() in (1, 3)
    md = _save_md(tmp_path, {"one": torch.zeros(1, 1), "three": torch.zeros(3, 1)})
    ref_r = _reads(ReferenceLoadPlanner(), sd, md)
    assert ref_r == _reads(DefaultLoadPlanner(), sd, md)
    assert [r[2] for r in ref_r] == [(1, 1), (3, 1)]


@pytest.mark.spec("REF-4", "REF-3", "API-4")
@pytest.mark.usefixtures("one_rank_group")
def test_both_paths_save_over_the_default_group_alike(tmp_path: Path) -> None:
    sd = {"s": sharded([(0, 3)]), "n": 5}
    a = refdcp.save(sd, checkpoint_id=tmp_path / "fast")
    b = refdcp.reference.save(sd, checkpoint_id=tmp_path / "ref")
    assert isinstance(a, Metadata) and isinstance(b, Metadata)
    assert a.state_dict_metadata == b.state_dict_metadata


@pytest.mark.spec("REF-4", "REF-3", "POLICY-1", "RESHARD-5")
@pytest.mark.parametrize("case", ["shape", "odd chunks"])
def test_both_load_planners_refuse_with_the_same_problems(case: str) -> None:
    md = _one_chunk_md(4)
    sd: dict[str, Any] = {"w": torch.zeros(6) if case == "shape" else _OddChunks()}
    got = []
    for planner in (ReferenceLoadPlanner(), DefaultLoadPlanner()):
        planner.set_up_planner(dict(sd), md, True)
        with pytest.raises(LoadPolicyError) as info:
            planner.create_local_plan()
        got.append(len(info.value.problems))
    assert got == [1, 1]


@pytest.mark.spec("REF-4", "REF-3", "LOAD-9")
def test_both_load_planners_refuse_an_object_outside_the_allow_list() -> None:
    md = Metadata(state_dict_metadata={"f": BytesStorageMetadata()})
    for planner in (ReferenceLoadPlanner(), DefaultLoadPlanner()):
        planner.set_up_planner({"f": None}, md, True)
        (ri,) = planner.create_local_plan().items
        buf = io.BytesIO()
        torch.save(_Opaque(), buf)
        buf.seek(0)
        with pytest.raises(UnsafeObjectError, match=r"'f'.*_Opaque"):
            planner.load_bytes(ri, buf)


@pytest.mark.spec("REF-4", "ONCE-8")
@pytest.mark.parametrize("ghost_rank", [None, 0, 1])
def test_read_once_readers_weigh_objects_and_unlisted_chunks_as_the_planner(
    ghost_rank: int | None,
) -> None:
    props = TensorProperties(dtype=torch.uint8)
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))
    md = Metadata(
        state_dict_metadata={
            "a": BytesStorageMetadata(),
            "b": TensorStorageMetadata(props, torch.Size([2]), [chunk]),
        }
    )
    obj, ten, ghost = MetadataIndex("a"), MetadataIndex("b", torch.Size([0])), None
    z = torch.Size([0])
    items = [ReadItem(LoadItemType.BYTE_IO, obj, z, obj, z, z)]
    items.append(ReadItem(LoadItemType.TENSOR, ten, z, ten, z, torch.Size([2])))
    ghost = MetadataIndex("b", torch.Size([1]))
    alone = ReadItem(LoadItemType.TENSOR, ghost, z, ghost, z, torch.Size([1]))
    plans = [LoadPlan([*items, alone] if r == ghost_rank else items) for r in range(2)]
    ref = read_once_readers(plans, md)
    assert ref == assign_readers(plans, md)
    assert ref == {("b", (0,)): 0, ("a", ()): 1}


@pytest.mark.spec("REF-4", "REF-3", "PLAN-1", "META-1")
def test_a_sharded_tensor_no_rank_holds_a_chunk_of_is_recorded_by_both(tmp_path: Path) -> None:
    def state(rank: int) -> dict[str, Any]:
        return {"none": refdcp.LocalShards((0, 3), [], dtype=torch.float32), "w": torch.ones(2)}

    mds = {}
    for impl, api in (("fast", refdcp), ("reference", refdcp.reference)):
        FakeWorld(2).run(
            lambda c, api=api, impl=impl: api.save(
                state(c.rank), checkpoint_id=tmp_path / impl, comm=c
            )
        )
        mds[impl] = refdcp.FileSystemReader(tmp_path / impl).read_metadata().state_dict_metadata
    assert mds["fast"] == mds["reference"]
    none = mds["reference"]["none"]
    assert isinstance(none, TensorStorageMetadata) and tuple(none.size) == (0, 3)


@pytest.mark.spec("REF-4", "REF-3", "PLAN-1", "PLAN-2")
def test_both_record_the_same_dtensors_a_rank_holds_no_chunk_of() -> None:
    """Rank 1 of a 2-rank mesh holds the empty shard of a (0, 4) tensor: recorded, without
    chunks; a (0, 5) tensor on a mesh without this rank is not recorded."""
    sd = {
        "e": dtensor(torch.ones(0, 4), (0, 4), [0, 1], 1),
        "o": dtensor(torch.ones(0, 5), (0, 5), [1, 2], 0),
        "w": torch.ones(2),
    }
    got = []
    for planner in (ReferenceSavePlanner(), DefaultSavePlanner()):
        planner.set_up_planner(sd, None, True)
        _, md = planner.create_global_plan([planner.create_local_plan()])
        got.append(md.state_dict_metadata)
    assert got[0] == got[1] and sorted(got[0]) == ["e", "w"]


@pytest.mark.spec("REF-4", "REF-3", "PLAN-1")
@pytest.mark.usefixtures("one_rank_group")
def test_both_plan_no_write_for_an_empty_sharded_tensor() -> None:
    sd = {"z": sharded([(0, 0)], width=1), "w": torch.ones(2)}
    ref = _writes(ReferenceSavePlanner(), sd)
    assert ref == _writes(DefaultSavePlanner(), sd) and [w[0] for w in ref] == ["w"]
