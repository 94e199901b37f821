"""The reference dedup and metadata rules checked against worked examples, not against the
fast path (DEDUP-2..7, META-2..4, META-7): which rank writes each replicated item and why,
the problems of disagreeing replicas, and the chunk checks of the global metadata.

The fast path is compared with these rules in test_planning_dedup_reference.py and
test_planning_metadata_reference.py; here each expected answer is written out by hand, so
the tests that run the reference fail on a wrong rule even where both paths would agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.reference.dedup import chunk_nbytes, reference_dedup
from refdcp.reference.metadata import chunk_problems, reference_metadata_problems


def obj(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def ten(
    fqn: str,
    n: int,
    *,
    at: int = 0,
    total: int | None = None,
    dtype: torch.dtype = torch.uint8,
    kind: WriteItemType = WriteItemType.SHARD,
) -> WriteItem:
    """A 1-d chunk of ``n`` elements at ``at`` of a ``total``-element tensor."""
    off = torch.Size([at])
    chunk = ChunkStorageMetadata(off, torch.Size([n]))
    size = torch.Size([n if total is None else total])
    data = TensorWriteData(chunk, TensorProperties(dtype=dtype), size)
    return WriteItem(index=MetadataIndex(fqn, off), type=kind, tensor_data=data)


def writers(kept: list[list[WriteItem]]) -> dict[str, int]:
    return {i.index.fqn: r for r, items in enumerate(kept) for i in items}


# -- dedup (DEDUP-2, DEDUP-3, DEDUP-5, DEDUP-7) ----------------------------------------------


@pytest.mark.spec("DEDUP-3")
def test_an_item_counts_its_chunk_bytes_and_an_object_one_byte() -> None:
    assert chunk_nbytes(ten("t", 6, total=12, dtype=torch.float32)) == 24
    assert chunk_nbytes(ten("t", 1)) == 1 and chunk_nbytes(obj("o")) == 1


@pytest.mark.spec("DEDUP-2", "DEDUP-3", "DEDUP-5")
def test_replicas_go_largest_first_to_the_least_loaded_holder() -> None:
    """Rank 1 alone holds 3 bytes; then the 8-byte item goes to rank 0 (load 0 < 3),
    the 4-byte one to rank 1 (3 < 8), and the two 2-byte ones to rank 1 (7 < 8), then
    to rank 0 (8 < 9)."""
    shared = [ten("s2a", 2), ten("s4", 4), ten("s8", 8), ten("s2b", 2)]
    plans = [shared, [ten("alone", 3), *shared]]
    kept, problems, decisions = reference_dedup(plans)
    assert problems == []
    assert writers(kept) == {"alone": 1, "s8": 0, "s4": 1, "s2a": 1, "s2b": 0}
    assert [(d.fqn, d.offsets, d.nbytes, d.holders, d.writer) for d in decisions] == [
        ("s8", (0,), 8, [0, 1], 0),
        ("s4", (0,), 4, [0, 1], 1),
        ("s2a", (0,), 2, [0, 1], 1),
        ("s2b", (0,), 2, [0, 1], 0),
    ]
    assert decisions[1].reason == "fewest bytes so far among holders (3 B; r0=8, r1=3)"


@pytest.mark.spec("DEDUP-2")
def test_the_lowest_holder_writes_with_dedup_save_to_lowest_rank() -> None:
    """Rank 1 is the most loaded holder, yet writes with ``lowest_rank``."""
    plans = [[], [ten("big", 9), ten("s", 2)], [ten("s", 2)]]
    for lowest, writer in ((True, 1), (False, 2)):
        kept, _, (decision,) = reference_dedup(plans, lowest_rank=lowest)
        assert writers(kept)["s"] == writer == decision.writer
        assert decision.reason.startswith("lowest holding rank") == lowest


@pytest.mark.spec("DEDUP-7")
@pytest.mark.parametrize(
    ("coordinator", "on_coordinator", "item", "writer", "why"),
    [
        (0, True, "o", 0, "non-tensor item"),  # the coordinator holds it: loads do not matter
        (0, False, "o", 1, "fewest bytes"),
        (2, True, "o", 1, "fewest bytes"),  # the coordinator does not hold it
        (0, True, "t", 1, "fewest bytes"),  # a tensor is not kept on the coordinator
    ],
)
def test_a_replicated_object_stays_on_the_coordinator_that_holds_it(
    coordinator: int, on_coordinator: bool, item: str, writer: int, why: str
) -> None:
    value = obj("o") if item == "o" else ten("t", 1, kind=WriteItemType.TENSOR)
    plans: list[list[WriteItem]] = [[ten("big", 9), value], [value], [ten("c", 1)]]
    kept, _, (decision,) = reference_dedup(
        plans, coordinator_rank=coordinator, bytes_on_coordinator=on_coordinator
    )
    assert writers(kept)[item] == writer == decision.writer
    assert decision.reason.startswith(why)


# -- disagreeing replicas (DEDUP-4, DEDUP-6) ---------------------------------------------------


@pytest.mark.spec("DEDUP-4")
@pytest.mark.parametrize(
    ("mine", "theirs", "said"),
    [
        (
            obj("x"),
            ten("x", 2, kind=WriteItemType.TENSOR),
            "ranks [0] hold a non-tensor object; ranks [1] hold a tensor of chunk shape (2,), "
            "dtype torch.uint8, global shape (2,)",
        ),
        (
            ten("x", 2),
            ten("x", 3),
            "ranks [0] hold a shard of chunk shape (2,), dtype torch.uint8, global shape (2,); "
            "ranks [1] hold a shard of chunk shape (3,), dtype torch.uint8, global shape (3,)",
        ),
    ],
)
def test_replicas_of_another_kind_or_shape_are_named_side_by_side(
    mine: WriteItem, theirs: WriteItem, said: str
) -> None:
    if mine.index.offset is None:  # an object and a tensor share the key only without offsets
        theirs = WriteItem(
            index=MetadataIndex("x"), type=theirs.type, tensor_data=theirs.tensor_data
        )
    _, problems, _ = reference_dedup([[mine], [theirs]])
    (problem,) = problems
    assert problem.endswith(f"disagree in type, dtype or shape: {said}")


@pytest.mark.spec("DEDUP-6")
def test_equal_shapes_with_other_checksums_differ_in_value() -> None:
    key = ("x", torch.Size([0]))
    plans = [[ten("x", 2)], [ten("x", 2)], [ten("x", 2)]]
    _, problems, _ = reference_dedup(plans, checksums=[{key: 1}, {key: 1}, {key: 2}])
    assert problems == [
        "replicas of 'x' chunk at offsets (0,) differ in value between ranks: "
        "ranks [0, 1] hold checksum 0x00000001; ranks [2] hold checksum 0x00000002"
    ]
    _, problems, _ = reference_dedup(plans, checksums=[{key: 1}, None, {key: 1}])
    assert problems == []


# -- the global metadata's chunk checks (META-2, META-3, META-4, META-7) ----------------------


@pytest.mark.spec("META-2", "META-3")
@pytest.mark.parametrize(
    ("size", "chunks", "problems"),
    [
        ((), [((), ())], []),
        ((), [], ["cover"]),
        ((), [((), ()), ((), ())], ["cover"]),
        ((4,), [((0,), (4,))], []),
        ((4,), [((0,), (2,))], ["cover"]),
        ((4,), [((0,), (2,)), ((2,), (2,))], []),  # touching is not overlapping
        ((4,), [((2,), (2,)), ((0,), (2,))], []),
        ((4,), [((0,), (3,)), ((2,), (2,))], ["overlap"]),
        ((4,), [((0,), (4,)), ((1,), (1,))], ["overlap"]),  # a one-element chunk inside
        ((4,), [((0,), (4,)), ((2,), (0,))], []),  # an empty chunk overlaps nothing
        ((4,), [((0,), (2,)), ((1,), (2,)), ((3,), (1,))], ["overlap"]),
        ((4,), [((2,), (3,))], ["outside"]),
        ((4,), [((-1,), (2,)), ((1,), (3,))], ["outside"]),
        ((4,), [((0, 0), (4, 1))], ["outside"]),  # another number of dimensions
        ((4, 4), [((0, 3), (4, 2)), ((0, 0), (4, 3))], ["outside"]),
    ],
)
def test_chunk_problems_worked_examples(
    size: tuple[int, ...], chunks: list[tuple[Any, Any]], problems: list[str]
) -> None:
    assert chunk_problems(size, chunks) == problems


@pytest.mark.spec("META-4", "META-7")
def test_metadata_problems_name_each_fqn_once_by_its_first_rule() -> None:
    """Objects first (several writers, or an object and a tensor), then tensors in listing
    order: a disagreement stops that tensor's checks, not the next tensor's; then tensors
    no rank wrote a chunk of."""
    wide = ten("d", 2, total=2)
    narrow = ten("d", 2, total=3)
    plans = [
        [obj("o"), obj("alone"), obj("x"), wide, ten("gap", 1, total=2)],
        [obj("o"), ten("x", 2), narrow, ten("after", 1, total=3)],
    ]
    props = TensorProperties(dtype=torch.uint8)
    unwritten = {"nobody": (props, torch.Size([2])), "empty": (props, torch.Size([0]))}
    unwritten["gap"] = (props, torch.Size([2]))  # also written: checked once, with its chunks
    assert reference_metadata_problems(plans, unwritten) == [
        ("o", "bytes"),
        ("x", "bytes"),
        ("d", "disagree"),
        ("gap", "cover"),
        ("after", "cover"),
        ("nobody", "cover"),
    ]
    assert reference_metadata_problems([[obj("o")], [ten("t", 1)]]) == []
