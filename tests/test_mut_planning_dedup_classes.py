"""Whole-plan dedup with classes of identical plans that hold objects (DEDUP-1, DEDUP-5,
DEDUP-12), and duplicate-key problems in rank order past rank 9 (DEDUP-15).

Every rank usually saves some plain values (a step counter, a config); a class of
ranks holding one such plan is not one of DEDUP-12's tensor-only classes and goes
through the general path, beside classes that DEDUP-12 solves on their own. Crossed
here: how many ranks each class has, whether it holds an object, and the classes'
order; the result must be the reference's (DEDUP-9).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.dedup.duplicates import duplicate_problems
from refdcp.planning.local_plan import item_key
from refdcp.reference.dedup import reference_dedup


def _plain_id(value: object) -> str:
    """A test id of letters, digits and underscores only (the mutation runner selects by id)."""
    return re.sub(r"\W+", "_", str(value)).strip("_") or "empty"


def _tensor(fqn: str, n: int) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([n])),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([n]),
        ),
    )


def _object(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _class_plan(c: int, with_object: bool) -> list[WriteItem]:
    items = [_tensor(f"c{c}.w", 4 + c), _tensor(f"c{c}.b", 2)]
    return [*items, _object(f"c{c}.step")] if with_object else items


SHAPES = list(itertools.product([1, 2, 3], [False, True]))


@pytest.mark.spec("DEDUP-1", "DEDUP-5", "DEDUP-12", "DEDUP-9")
@pytest.mark.parametrize("first", SHAPES, ids=_plain_id)
@pytest.mark.parametrize("second", SHAPES, ids=_plain_id)
@pytest.mark.parametrize("lowest_rank", [False, True])
def test_classes_with_and_without_objects_match_the_reference(
    first: tuple[int, bool], second: tuple[int, bool], lowest_rank: bool
) -> None:
    plans: list[list[WriteItem]] = []
    for c, (members, with_object) in enumerate([first, second]):
        plans += [_class_plan(c, with_object) for _ in range(members)]
    got = dedup_items(plans, lowest_rank=lowest_rank)
    kept, problems, _ = reference_dedup(plans, lowest_rank=lowest_rank)
    assert got.problems == problems == []
    assert [list(map(item_key, p)) for p in got.plans] == [list(map(item_key, p)) for p in kept]
    written = [item_key(i) for p in got.plans for i in p]  # each key once, all of them
    assert sorted(written, key=repr) == sorted({item_key(i) for p in plans for i in p}, key=repr)


@pytest.mark.spec("DEDUP-15")
@pytest.mark.parametrize("ranks", [(10, 9), (9, 10), (2, 11, 1)], ids=_plain_id)
def test_duplicate_problems_are_in_rank_order_past_rank_nine(ranks: tuple[int, ...]) -> None:
    key = ("w", torch.Size([0]))
    problems = duplicate_problems((r, [key]) for r in ranks)
    assert [int(p.split()[1].removesuffix("'s")) for p in problems] == sorted(ranks)
