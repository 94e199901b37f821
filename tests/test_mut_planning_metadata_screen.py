"""Survivors of the planning full run in ``metadata/build.py``: the screen's soundness (META-3),
what it clears without the exact check (META-9), and shared values (META-8).

All through ``build_state_dict_metadata``; the exact per-tensor check is watched with a
spy on the module's ``_check_chunks``, as in ``test_global_metadata_scale.py``.
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
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.planning.metadata import build as global_metadata
from refdcp.planning.metadata.build import build_state_dict_metadata
from refdcp.reference.metadata import reference_metadata_problems


def _plain_id(value: object) -> str:
    """A test id of letters, digits and underscores only (the mutation runner selects by id)."""
    return re.sub(r"\W+", "_", str(value)).strip("_") or "empty"


def _item(fqn: str, off: tuple[int, ...], sz: tuple[int, ...], glob: tuple[int, ...]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(off)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sz)),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(glob),
        ),
    )


def _exact_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    exact = global_metadata._check_chunks

    def spy(fqn: str, md: TensorStorageMetadata, ranks: list[int]) -> list[str]:
        seen.append(fqn)
        return exact(fqn, md, ranks)

    monkeypatch.setattr(global_metadata, "_check_chunks", spy)
    return seen


# Chunks of a 2 x 3 tensor whose volumes add up to 6 while one cell is covered twice and
# another not at all, in plan orders where each chunk and the next lie in one slab only
# if a slab is matched by its start alone: the screen must not clear them.
OVERLAP_AND_HOLE = [
    ((0, 0), (1, 3)),  # row 0
    ((2, 1), (0, 0)),  # empty
    ((1, 1), (1, 1)),  # (1, 1)
    ((0, 2), (2, 1)),  # column 2: (0, 2) again, and (1, 2); (1, 0) is left uncovered
]


@pytest.mark.spec("META-3", "META-6")
@pytest.mark.parametrize("order", list(itertools.permutations(range(4))), ids=_plain_id)
@pytest.mark.parametrize("world", [1, 2])
def test_an_overlap_hidden_by_a_hole_of_the_same_volume_is_reported(
    order: tuple[int, ...], world: int
) -> None:
    items = [_item("w", *OVERLAP_AND_HOLE[i], (2, 3)) for i in order]
    plans = [items[r::world] for r in range(world)]
    _, problems = build_state_dict_metadata(plans)
    assert any(p.startswith("'w'") and "overlaps" in p for p in problems), problems
    assert ("w", "overlap") in set(reference_metadata_problems(plans))


@pytest.mark.spec("META-9")
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("empty_at", ["end", "start", "middle"])
def test_slabs_with_an_empty_one_skip_the_exact_check(
    dim: int, empty_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven sharding gives slabs of which one is empty (7 rows over 4 ranks: 2, 2, 2, 1 or
    a 0-row last shard): still a slab layout, cleared by the screen."""
    glob = (6, 5) if dim == 0 else (5, 6)
    lengths = {"end": [2, 2, 2, 0], "start": [0, 3, 3], "middle": [3, 0, 3]}[empty_at]
    items, start = [], 0
    for n in lengths:
        off = (start, 0) if dim == 0 else (0, start)
        sz = (n, 5) if dim == 0 else (5, n)
        items.append(_item("w", off, sz, glob))
        start += n
    seen = _exact_checks(monkeypatch)
    md, problems = build_state_dict_metadata([items[r::2] for r in range(2)])
    assert problems == []
    assert seen == []
    assert len(md["w"].chunks) == len(lengths)  # type: ignore[union-attr]


@pytest.mark.spec("META-8")
def test_equal_sizes_built_apart_are_one_object() -> None:
    """Chunks of sharded tensors carry their own ``torch.Size`` objects; in the metadata every
    equal value among global sizes, chunk offsets and chunk sizes is one object (and the
    values are unchanged)."""
    plans = []
    for r in range(4):  # each rank builds its own objects
        plans.append(
            [
                _item("a", (2 * r, 0), (2, 4), (8, 4)),
                _item("b", (0, 2 * r), (4, 2), (4, 8)),
                _item("c", (2 * r,), (2,), (8,)),
            ]
        )
    md, problems = build_state_dict_metadata(plans)
    assert problems == []
    seen: dict[tuple[int, ...], int] = {}
    for fqn in "abc":
        entry = md[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        values = [entry.size]
        for c in entry.chunks:
            values += [c.offsets, c.sizes]
        for v in values:
            assert type(v) is torch.Size
            assert seen.setdefault(tuple(v), id(v)) == id(v), (fqn, v)
    a = md["a"]
    assert isinstance(a, TensorStorageMetadata)
    assert [(list(c.offsets), list(c.sizes)) for c in a.chunks] == [
        ([2 * r, 0], [2, 4]) for r in range(4)
    ]
