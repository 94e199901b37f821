"""The reference planners on sharded values and on the paths no save/load round trip reaches
(PLAN-1, PLAN-2, PLAN-6, API-4, FLAT-6, LOAD-9, POLICY-1, RESHARD-5, ONCE-1, STORE-12).

DTensors live on device meshes built without a process group (``_init_backend=False``);
a ``ShardedTensor`` and torch's default group need a group, so those tests start a
one-rank Gloo group in this process (an in-memory store, no other process) and end it.
The fast path's answers for the same values are compared in
``test_mut_reference_sharded_differential.py``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItemType,
)

import refdcp.reference
from refdcp.comm import SingleRank
from refdcp.planning import LoadPolicyError, PlanValidationError
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.reference import ReferenceReader
from refdcp.reference.load_planner import (
    ReferenceLoadPlanner,
    _coverage_problem,
    read_once_readers,
    wanted_chunks,
)
from refdcp.reference.save_planner import ReferenceSavePlanner, chunk_of, write_items
from refdcp.storage.errors import UnsafeObjectError

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"


def dtensor(local: torch.Tensor, shape: tuple[int, ...], mesh: list[int], rank: int) -> Any:
    """A DTensor sharded on dim 0 over ``mesh`` as seen by ``rank`` (no process group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    dm = DeviceMesh("cpu", mesh, _init_backend=False, _rank=rank)
    stride = torch.empty(shape).stride()
    spec = DTensorSpec(dm, (Shard(0),), TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def partial_dtensor() -> Any:
    """Replicated on one dimension of a 2-d mesh, Partial on the other."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    dm = DeviceMesh("cpu", [[0]], _init_backend=False, _rank=0)
    meta = TensorMeta(torch.Size((2,)), (1,), torch.float32)
    spec = DTensorSpec(dm, (Replicate(), Partial()), meta)
    return DTensor(torch.ones(2), spec, requires_grad=False)  # type: ignore[no-untyped-call]


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """torch's default process group with one rank, in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(shards: list[tuple[int, int]], width: int = 2) -> Any:
    """A ShardedTensor of ``(rows_at, rows)`` shards of a ``(sum rows, width)`` tensor, all on
    this rank; shard ``i`` holds the value ``i + 1``."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

    local = [
        Shard(
            torch.full((n, width), float(i + 1)), ShardMetadata([at, 0], [n, width], "rank:0/cpu")
        )
        for i, (at, n) in enumerate(shards)
    ]
    return ShardedTensor._init_from_local_shards(local, (sum(n for _, n in shards), width))


# -- DTensors (PLAN-1, PLAN-2) ---------------------------------------------------------------


@pytest.mark.spec("PLAN-2", "PLAN-1")
def test_dtensors_by_mesh_membership_and_placement() -> None:
    inside = dtensor(torch.ones(3, 4), (3, 4), [0], 0)
    (item,) = write_items("d", inside)
    assert item.type == WriteItemType.SHARD and item.tensor_data is not None
    assert tuple(item.tensor_data.chunk.sizes) == (3, 4)
    assert [tuple(c.sizes) for c in wanted_chunks(inside)] == [(3, 4)]
    outside = dtensor(torch.ones(0, 4), (3, 4), [1], 0)  # the mesh lacks rank 0
    assert write_items("d", outside) == [] and wanted_chunks(outside) == []
    with pytest.raises(ValueError, match="'p' is a DTensor with a Partial placement"):
        write_items("p", partial_dtensor())


@pytest.mark.spec("PLAN-2", "PLAN-1")
def test_only_ranks_of_the_mesh_record_a_sharded_tensor_they_hold_no_chunk_of() -> None:
    """A mesh rank whose shard is empty plans no item but records the key (with its shape);
    a rank outside the mesh records nothing."""
    empty_here = dtensor(torch.ones(0, 4), (1, 4), [0, 1], 1)
    outside = dtensor(torch.ones(0, 4), (1, 4), [1, 2], 0)
    planner = ReferenceSavePlanner()
    planner.set_up_planner({"e": empty_here, "o": outside}, None, False)
    plan = planner.create_local_plan()
    assert plan.items == []
    record = plan.planner_data[RESERVED_KEY]["without_chunks"]
    assert list(record) == ["e"] and tuple(record["e"][1]) == (1, 4)


@pytest.mark.spec("PLAN-2", "RESHARD-1")
def test_a_dtensor_load_plans_reads_only_on_mesh_ranks(tmp_path: Path) -> None:
    refdcp.reference.save({"d": torch.arange(6.0).reshape(3, 2)}, checkpoint_id=tmp_path)
    md = ReferenceReader(tmp_path).read_metadata()
    for mesh, reads in (([0], 1), ([1], 0)):
        local = torch.zeros(3 if reads else 0, 2)
        planner = ReferenceLoadPlanner()
        planner.set_up_planner({"d": dtensor(local, (3, 2), mesh, 0)}, md, True)
        assert len(planner.create_local_plan().items) == reads


# -- ShardedTensor (PLAN-1, PLAN-6) ------------------------------------------------------------


@pytest.mark.spec("PLAN-1", "PLAN-6")
@pytest.mark.usefixtures("one_rank_group")
def test_a_sharded_tensor_plans_its_non_empty_shards_and_resolves_each() -> None:
    st = sharded([(0, 1), (1, 3), (4, 0)], width=1)  # one element, three, none
    items = write_items("s", st)
    assert [(tuple(i.index.offset), i.type) for i in items] == [
        ((0, 0), WriteItemType.SHARD),
        ((1, 0), WriteItemType.SHARD),
    ]
    assert [tuple(i.tensor_data.chunk.sizes) for i in items if i.tensor_data] == [(1, 1), (3, 1)]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in wanted_chunks(st)] == [
        ((0, 0), (1, 1)),
        ((1, 0), (3, 1)),
        ((4, 0), (0, 1)),
    ]
    for i, shard in enumerate(st.local_shards()[:2]):
        got = chunk_of(st, MetadataIndex("s", torch.Size(shard.metadata.shard_offsets)))
        assert got is shard.tensor and float(got.flatten()[0]) == i + 1
    with pytest.raises(ValueError, match="'s' has no local shard at"):
        chunk_of(st, MetadataIndex("s", torch.Size([2, 0])))


@pytest.mark.spec("API-4", "REF-1")
@pytest.mark.usefixtures("one_rank_group")
def test_without_comm_the_reference_uses_the_default_group(tmp_path: Path) -> None:
    st = sharded([(0, 2), (2, 1)])
    md = refdcp.reference.save({"s": st, "n": 5}, checkpoint_id=tmp_path)
    assert isinstance(md, Metadata)
    back = {"s": sharded([(0, 2), (2, 1)]), "n": 0}
    for shard in back["s"].local_shards():
        shard.tensor.zero_()
    refdcp.reference.load(back, checkpoint_id=tmp_path)
    assert back["n"] == 5
    assert [float(s.tensor.sum()) for s in back["s"].local_shards()] == [4.0, 4.0]


# -- refusals no round trip reaches (FLAT-6, LOAD-9, POLICY-1, RESHARD-5, STORE-12) -----------


@pytest.mark.spec("FLAT-6")
def test_the_coordinator_refuses_the_reserved_fqn_in_a_plan_it_is_sent() -> None:
    """A rank whose planner let the reserved key through is caught by the coordinator."""
    planner = ReferenceSavePlanner()
    planner.set_up_planner({"w": torch.ones(2)}, None, True)
    plan = planner.create_local_plan()
    (item,) = plan.items
    bad = item.__class__(
        index=MetadataIndex(RESERVED_KEY, item.index.offset),
        type=item.type,
        tensor_data=item.tensor_data,
    )
    data = dict(plan.planner_data)
    record = dict(data[RESERVED_KEY])
    record["checksums"] = None
    data[RESERVED_KEY] = record
    with pytest.raises(PlanValidationError, match="is reserved by refdcp's planner"):
        planner.create_global_plan([SavePlan([bad], planner_data=data)])


class _Opaque:
    """A class no allow-list names."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)

    __hash__ = object.__hash__


@pytest.mark.spec("LOAD-9", "PLAN-7")
def test_load_bytes_refuses_a_global_outside_the_allow_list() -> None:
    planner = ReferenceLoadPlanner()
    md = Metadata(state_dict_metadata={"f": BytesStorageMetadata()})
    planner.set_up_planner({"f": None}, md, True)
    (ri,) = planner.create_local_plan().items
    buf = io.BytesIO()
    torch.save(_Opaque(), buf)
    buf.seek(0)
    with pytest.raises(UnsafeObjectError, match=r"'f'.*_Opaque"):
        planner.load_bytes(ri, buf)
    planner.safe_globals.append(_Opaque)
    buf.seek(0)
    planner.load_bytes(ri, buf)
    assert planner.state_dict["f"] == _Opaque()


def _one_chunk_md(n: int) -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([n]))
    return Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([n]), [chunk])}
    )


@pytest.mark.spec("POLICY-1", "RESHARD-5")
def test_a_policy_problem_is_reported_alone_before_any_read_is_planned() -> None:
    """A shape mismatch is the one problem: no coverage problem of reads planned after it."""
    planner = ReferenceLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(6)}, _one_chunk_md(4), True)
    with pytest.raises(LoadPolicyError) as info:
        planner.create_local_plan()
    assert len(info.value.problems) == 1 and "shape mismatch" in info.value.problems[0]


class _OddChunks:
    """A checkpointable value (torch's protocol, duck-typed) whose chunk list lies partly
    outside its own size."""

    dtype = torch.float32

    def size(self) -> torch.Size:
        return torch.Size([4])

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size([2]), torch.Size([4]))]


@pytest.mark.spec("RESHARD-5")
def test_reads_that_leave_a_target_chunk_partly_unread_are_refused() -> None:
    planner = ReferenceLoadPlanner()
    planner.set_up_planner({"w": _OddChunks()}, _one_chunk_md(4), True)
    with pytest.raises(LoadPolicyError, match=r"leave elements unread .* \(2 of 4 elements"):
        planner.create_local_plan()


def _read(box: tuple[int, int]) -> ReadItem:
    where = MetadataIndex("w", torch.Size([box[0]]))
    return ReadItem(
        LoadItemType.TENSOR, where, torch.Size([0]), where, torch.Size([0]), torch.Size([box[1]])
    )


@pytest.mark.spec("RESHARD-5")
@pytest.mark.parametrize(
    ("boxes", "problem"),
    [([(0, 4)], None), ([(0, 2)], "leave elements unread"), ([(0, 4), (2, 2)], "overlap")],
)
def test_the_coverage_problem_names_holes_and_overlaps(
    boxes: list[tuple[int, int]], problem: str | None
) -> None:
    target = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
    got = _coverage_problem("w", target, [_read(b) for b in boxes])
    if problem is None:
        assert got == []
    else:
        (message,) = got
        n = sum(b[1] for b in boxes)
        assert problem in message and f"({n} of 4 elements read)" in message


@pytest.mark.spec("ONCE-1", "DEDUP-3")
def test_a_shared_object_counts_one_byte_when_readers_are_balanced() -> None:
    """A 2-byte chunk and an object, both read by ranks 0 and 1: the chunk is larger, so it
    goes first (to rank 0), and the object (1 byte) to the less loaded rank 1. A stored chunk
    the metadata does not list counts 0 bytes."""
    props = TensorProperties(dtype=torch.uint8)
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))
    md = Metadata(
        state_dict_metadata={
            "a": BytesStorageMetadata(),
            "b": TensorStorageMetadata(props, torch.Size([2]), [chunk]),
        }
    )
    obj, ten = MetadataIndex("a"), MetadataIndex("b", torch.Size([0]))
    z = torch.Size([0])
    items = [ReadItem(LoadItemType.BYTE_IO, obj, z, obj, z, z)]
    items.append(ReadItem(LoadItemType.TENSOR, ten, z, ten, z, torch.Size([2])))
    plans = [LoadPlan(items), LoadPlan(items)]
    assert read_once_readers(plans, md) == {("b", (0,)): 0, ("a", ()): 1}
    # an unlisted chunk of "b" (0 bytes) read by rank 0 alone leaves the balance as it was
    ghost = MetadataIndex("b", torch.Size([1]))
    alone = ReadItem(LoadItemType.TENSOR, ghost, z, ghost, z, torch.Size([1]))
    assert read_once_readers([LoadPlan([*items, alone]), LoadPlan(items)], md) == {
        ("b", (0,)): 0,
        ("a", ()): 1,
    }


class _WrongSize(ReferenceLoadPlanner):
    """Hands the reader a destination one row larger than the read's box."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return torch.zeros(math.prod(read_item.lengths) + 1)


@pytest.mark.spec("STORE-12")
def test_the_reader_refuses_a_destination_of_another_size(tmp_path: Path) -> None:
    refdcp.reference.save({"w": torch.ones(1)}, checkpoint_id=tmp_path, comm=SingleRank())
    reader = ReferenceReader(tmp_path)
    md = reader.read_metadata()
    planner = _WrongSize()
    planner.set_up_planner({"w": torch.zeros(1)}, md, True)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(md, True)
    with pytest.raises(ValueError, match=r"'w': destination \[2\] does not match the read \[1\]"):
        reader.read_data(plan, planner)


def _chunk(at: int, n: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size([at]), torch.Size([n]))


@pytest.mark.spec("RESHARD-1", "RESHARD-3")
def test_reads_skip_empty_and_touching_saved_chunks_and_go_on() -> None:
    """An empty saved chunk listed first, and one that only touches the target, give no read;
    the chunks after them still do."""
    from refdcp.reference.load_planner import reads_for_chunk

    saved = [_chunk(0, 0), _chunk(0, 2), _chunk(2, 2), _chunk(4, 4)]
    reads = reads_for_chunk("w", 0, _chunk(2, 2), saved)
    assert [(tuple(r.storage_index.offset), tuple(r.lengths)) for r in reads] == [((2,), (2,))]
    reads = reads_for_chunk("w", 0, _chunk(0, 8), saved)
    assert [tuple(r.storage_index.offset) for r in reads] == [(0,), (2,), (4,)]


@pytest.mark.spec("ONCE-1", "DEDUP-3")
def test_each_rank_starts_at_the_bytes_it_alone_reads() -> None:
    """Rank 0 alone reads 6 bytes (3 int16), rank 1 alone 5 bytes (5 uint8): the shared
    6-byte chunk goes to rank 1, the less loaded."""
    md = Metadata(
        state_dict_metadata={
            k: TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size([n]), [_chunk(0, n)])
            for k, dt, n in (("c", torch.int16, 3), ("d", torch.uint8, 5), ("s", torch.int16, 3))
        }
    )
    z = torch.Size([0])

    def read(fqn: str) -> ReadItem:
        where = MetadataIndex(fqn, z)
        return ReadItem(LoadItemType.TENSOR, where, z, where, z, torch.Size([1]))

    plans = [LoadPlan([read("c"), read("s")]), LoadPlan([read("d"), read("s")])]
    assert read_once_readers(plans, md) == {("s", (0,)): 1}


class _Committed(ReferenceLoadPlanner):
    """Records each read it is handed back (commit_tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[tuple[str, torch.Tensor]] = []

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append((read_item.dest_index.fqn, tensor.clone()))


@pytest.mark.spec("STORE-12")
def test_the_reader_hands_each_filled_tensor_back_to_the_planner(tmp_path: Path) -> None:
    refdcp.reference.save({"w": torch.arange(3.0), "o": "x"}, checkpoint_id=tmp_path)
    reader = ReferenceReader(tmp_path)
    md = reader.read_metadata()
    planner = _Committed()
    planner.set_up_planner({"w": torch.zeros(3), "o": ""}, md, True)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(md, True)
    reader.read_data(plan, planner).wait()
    assert [fqn for fqn, _ in planner.committed] == ["w"]
    assert torch.equal(planner.committed[0][1], torch.arange(3.0))
