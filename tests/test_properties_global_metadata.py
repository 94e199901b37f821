"""Global metadata validation against a brute-force oracle (META-2..META-5).

Chunk sets start as exact tilings and are then perturbed (shifted, grown,
shrunk, dropped, duplicated, moved out of bounds, or an overlap that exactly
compensates a hole). A cell-counting oracle says which tensors are valid; the
vectorised screen plus the worded check must report exactly the invalid ones.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.planning.metadata.build import build_state_dict_metadata

Box = tuple[tuple[int, ...], tuple[int, ...]]


def item(
    fqn: str,
    off: tuple[int, ...],
    size: tuple[int, ...],
    glob: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(off)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(glob),
        ),
    )


def tiling(shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    per_dim = []
    for g in shape:
        cuts = sorted({rng.randint(1, g - 1) for _ in range(rng.randint(0, 2))} if g > 1 else set())
        edges = [0, *cuts, g]
        per_dim.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    boxes: list[Box] = [((), ())]
    for parts in per_dim:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in parts]
    return boxes


def perturb(boxes: list[Box], shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    boxes = list(boxes)
    i, d = rng.randrange(len(boxes)), rng.randrange(len(shape))
    off, size = list(boxes[i][0]), list(boxes[i][1])
    how = rng.choice(["shift", "grow", "shrink", "drop", "dup", "outside", "negative"])
    if how == "shift":
        off[d] += rng.choice([-1, 1])
    elif how == "grow":
        size[d] += 1
    elif how == "shrink" and size[d] > 0:
        size[d] -= 1
    elif how == "drop":
        del boxes[i]
        return boxes
    elif how == "dup":
        return [*boxes, boxes[i]]
    elif how == "outside":
        off[d] = shape[d] + rng.randint(0, 2)
    else:
        off[d] = -1
    boxes[i] = (tuple(off), tuple(size))
    return boxes


def oracle(boxes: list[Box], shape: tuple[int, ...]) -> tuple[bool, bool, bool]:
    """(valid, some chunk outside, some cell covered twice) by counting cells."""
    count = np.zeros(shape, dtype=np.int64)
    outside = False
    for off, size in boxes:
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, size, shape)):
            outside = True
            continue
        count[tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
    twice = bool((count > 1).any())
    return (not outside and bool((count == 1).all())), outside, twice


@st.composite
def worlds(
    draw: st.DrawFn,
) -> tuple[list[list[WriteItem]], dict[str, tuple[list[Box], tuple[int, ...]]]]:
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    world = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))  # one ndim for all: the screen vectorises them together
    tensors = {}
    for t in range(draw(st.integers(1, 4))):
        shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        boxes = tiling(shape, rng)
        if draw(st.booleans()):
            boxes = perturb(boxes, shape, rng)
        tensors[f"t{t}"] = (boxes, shape)
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for fqn, (boxes, shape) in tensors.items():
        for off, size in boxes:
            plans[rng.randrange(world)].append(item(fqn, off, size, shape))
    for p in plans:  # a rank never writes one chunk twice; duplicates go to another rank
        seen = set()
        for it in list(p):
            key = (it.index.fqn, tuple(it.index.offset or ()))
            if key in seen:
                p.remove(it)
                plans[(plans.index(p) + 1) % world].append(it)
            seen.add(key)
    return plans, tensors


@pytest.mark.spec("META-2", "META-3", "META-5")
@given(worlds())
def test_exactly_the_invalid_tensors_are_reported(
    case: tuple[list[list[WriteItem]], dict[str, tuple[list[Box], tuple[int, ...]]]],
) -> None:
    plans, tensors = case
    if len(plans) == 1 and any(len(b) != len(set(b)) for b, _ in tensors.values()):
        return  # one rank cannot hold the same chunk twice (a dict key); nothing to check
    _, problems = build_state_dict_metadata(plans)
    for fqn, (boxes, shape) in tensors.items():
        if not boxes:
            continue  # its only chunk was dropped: no rank mentions the tensor at all
        valid, outside, twice = oracle(boxes, shape)
        mine = [p for p in problems if p.startswith(f"{fqn!r}")]
        assert bool(mine) != valid, (fqn, boxes, shape, problems)
        # each kind of message appears exactly when the oracle sees that kind of fault
        assert any("outside the global shape" in p for p in mine) == outside, (boxes, mine)
        assert any("overlaps" in p for p in mine) == twice, (boxes, mine)
        if not outside and not twice:
            assert any(" cover " in p for p in mine) != valid, (boxes, mine)


@pytest.mark.spec("META-3")
@pytest.mark.parametrize("ndim", [1, 2])
def test_an_overlap_that_fills_in_for_a_hole_is_still_reported(ndim: int) -> None:
    # volumes add up to the global size: only the overlap/gap checks can see it
    if ndim == 1:
        boxes, shape = [((0,), (2,)), ((1,), (2,))], (4,)
    else:
        boxes, shape = [((0, 0), (2, 4)), ((1, 0), (2, 4))], (4, 4)
    _, problems = build_state_dict_metadata([[item("x", o, s, shape) for o, s in boxes]])
    assert any("overlaps" in p for p in problems), problems


@pytest.mark.spec("META-2")
def test_a_chunk_shifted_out_of_bounds_with_the_right_volume_is_reported() -> None:
    boxes = [((0,), (2,)), ((3,), (2,))]  # [3, 5) of a (4,) tensor: total volume 4
    _, problems = build_state_dict_metadata([[item("x", o, s, (4,)) for o, s in boxes]])
    assert any("outside the global shape" in p and "offsets [3]" in p for p in problems), problems


@pytest.mark.spec("META-3", "META-5")
@pytest.mark.parametrize(("pairs", "more"), [(20, None), (21, 1), (25, 5)])
def test_overlap_list_is_capped_at_twenty_pairs_with_a_count_of_the_rest(
    pairs: int, more: int | None
) -> None:
    # one long chunk overlapping `pairs` short ones
    items = [item("x", (0,), (pairs,), (pairs,))] + [
        item("x", (i,), (1,), (pairs,)) for i in range(pairs)
    ]
    _, problems = build_state_dict_metadata([items[:1], items[1:]])
    listed = [p for p in problems if "overlaps chunk" in p]
    assert len(listed) == min(pairs, 20)
    rest = [p for p in problems if "more overlapping chunk pairs" in p]
    assert rest == ([] if more is None else [f"'x': {more} more overlapping chunk pairs"])


@pytest.mark.spec("META-4", "META-5")
def test_ranks_disagreeing_on_the_number_of_dims_are_named() -> None:
    plans = [[item("x", (0,), (4,), (4,))], [item("x", (0, 0), (2, 2), (2, 2))]]
    _, problems = build_state_dict_metadata(plans)
    text = "\n".join(problems)
    assert "'x': ranks disagree on dtype or global shape" in text
    assert "ranks [0] say dtype torch.float32 and global shape [4]" in text
    assert "ranks [1] say dtype torch.float32 and global shape [2, 2]" in text


@pytest.mark.spec("META-2", "META-5")
def test_a_chunk_of_the_wrong_rank_is_reported_not_a_crash() -> None:
    # three chunks of a 2-D tensor, one with 1-D offsets and sizes
    plans = [
        [item("x", (0, 0), (1, 2), (3, 2)), item("x", (1, 0), (1, 2), (3, 2))],
        [item("x", (2,), (2,), (3, 2))],
    ]
    _, problems = build_state_dict_metadata(plans)
    assert any("outside the global shape" in p and "rank 1" in p for p in problems), problems
    # offsets and sizes of different ranks from one another (3 chunks: 5 numbers for 3 x 2)
    for off, size in [((2,), (1, 2)), ((2, 0), (2,))]:
        plans = [
            [item("x", (0, 0), (1, 2), (3, 2)), item("x", (1, 0), (1, 2), (3, 2))],
            [item("x", off, size, (3, 2))],
        ]
        _, problems = build_state_dict_metadata(plans)
        assert any("outside the global shape" in p and "rank 1" in p for p in problems), problems


@pytest.mark.spec("META-3", "META-5")
def test_a_0d_tensor_written_twice_or_not_at_all_is_reported() -> None:
    twice = [[item("s", (), (), ())], [item("s", (), (), ())]]
    _, problems = build_state_dict_metadata(twice)
    assert any(
        "a 0-d tensor needs exactly one chunk, got 2 from ranks [0, 1]" in p for p in problems
    )
    _, fine = build_state_dict_metadata([[item("s", (), (), ())], []])
    assert fine == []


@pytest.mark.spec("META-3", "META-2")
@pytest.mark.parametrize(
    ("boxes", "shape"),
    [
        ([((0,), (2,)), ((2,), (1,))], (4,)),  # a hole after two touching chunks
        ([((0,), (1,)), ((1,), (1,)), ((3,), (1,))], (4,)),
        ([((0, 0), (2, 4)), ((2, 0), (1, 4))], (4, 4)),
    ],
)
def test_a_hole_is_reported_as_a_hole_only(boxes: list[Box], shape: tuple[int, ...]) -> None:
    _, problems = build_state_dict_metadata([[item("x", o, s, shape) for o, s in boxes]])
    assert len(problems) == 1 and " cover " in problems[0], problems
