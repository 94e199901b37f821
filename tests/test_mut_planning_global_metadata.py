"""Global metadata against the plain reference on small, dense random chunk sets
(META-1..6).

``test_planning_metadata_reference.py`` draws damaged tilings; here every chunk
is drawn freely (offsets from -1 to past the end, sizes from 0 to past the
end, 1-element chunks at offset 0, the same chunk on two ranks), so every
boundary of the checks is hit often. Properties, through the module's public
function ``build_state_dict_metadata`` only:

* the problems found are, as ``(fqn, kind)``, exactly the reference's (META-6);
* every problem names its FQN, and an overlap names the ranks of both chunks (META-5);
* the metadata of a valid plan records every chunk exactly once, with the
  tensor's dtype and global shape, and ``BytesStorageMetadata`` for objects (META-1).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.planning.metadata.build import build_state_dict_metadata
from refdcp.reference.metadata import reference_metadata_problems

KINDS = {
    "bytes by several": "bytes",
    "but bytes on ranks": "bytes",
    "disagree on dtype or global shape": "disagree",
    "outside the global shape": "outside",
    "overlap": "overlap",
    "cover": "cover",
    "needs exactly one chunk": "cover",
}


def _kind(problem: str) -> tuple[str, str]:
    fqn = problem.split("'")[1]
    for words, kind in KINDS.items():
        if words in problem:
            return fqn, kind
    raise AssertionError(f"unclassified problem: {problem}")


def _tensor(
    fqn: str,
    off: tuple[int, ...],
    sz: tuple[int, ...],
    size: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(off)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sz)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _object(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


@st.composite
def dense_plans(draw: st.DrawFn) -> list[list[WriteItem]]:
    """A few tiny tensors whose chunks are drawn freely, and a few objects."""
    world = draw(st.integers(1, 3))
    rng = random.Random(draw(st.integers(0, 10**6)))
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for t in range(draw(st.integers(1, 3))):
        fqn = f"t{t}"
        ndim = rng.choice([1, 1, 2, 2, 3])
        size = tuple(rng.randint(1, 5 if ndim == 1 else 3) for _ in range(ndim))
        chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        if rng.random() < 0.5:  # start from a valid tiling along dim 0, then damage it
            cuts = sorted({0, *(rng.randint(0, size[0]) for _ in range(2))})
            ends = [*cuts[1:], size[0]]
            chunks = [((a, *[0] * (ndim - 1)), (b - a, *size[1:])) for a, b in zip(cuts, ends)]
        for _ in range(rng.randint(0, 4)):
            if chunks and rng.random() < 0.4:
                chunks.append(rng.choice(chunks))  # the same chunk again (another rank)
            else:
                off = tuple(rng.randint(-1 if rng.random() < 0.1 else 0, g) for g in size)
                sz = tuple(rng.randint(0, g + (rng.random() < 0.1)) for g in size)
                chunks.append((off, sz))
        for off, sz in chunks:
            plans[rng.randrange(world)].append(_tensor(fqn, off, sz, size))
    for o in range(draw(st.integers(0, 2))):
        for r in rng.sample(range(world), rng.randint(1, world)):
            plans[r].append(_object(f"o{o}"))
    return plans


@pytest.mark.spec("META-6", "META-2", "META-3", "META-4")
@settings(max_examples=400)  # cheap examples
@given(dense_plans())
def test_the_problems_found_are_the_references_for_dense_random_chunks(
    plans: list[list[WriteItem]],
) -> None:
    _, problems = build_state_dict_metadata(plans)
    assert {_kind(p) for p in problems} == set(reference_metadata_problems(plans))


@pytest.mark.spec("META-5", "META-3")
@settings(max_examples=200)
@given(dense_plans())
def test_every_problem_names_its_fqn_and_an_overlap_names_both_ranks(
    plans: list[list[WriteItem]],
) -> None:
    _, problems = build_state_dict_metadata(plans)
    fqns = {i.index.fqn for items in plans for i in items}
    for p in problems:
        assert p.split("'")[1] in fqns
        if " overlaps chunk " in p:
            assert p.count("from rank ") == 2


@pytest.mark.spec("META-3", "META-5")
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("length", [1, 2, 3])
def test_the_same_chunk_from_two_ranks_is_an_overlap_even_when_the_volume_adds_up(
    ndim: int, length: int
) -> None:
    # chunk [0, 1) twice in a tensor of 2 elements along dim 0: the volume matches the
    # tensor's, so only the overlap check can refuse it
    size = (2 * length, *[1] * (ndim - 1))
    off = (0,) * ndim
    sz = (length, *[1] * (ndim - 1))
    plans = [[_tensor("w", off, sz, size)], [_tensor("w", off, sz, size)]]
    _, problems = build_state_dict_metadata(plans)
    assert any("'w'" in p and "overlaps" in p and "rank 0" in p and "rank 1" in p for p in problems)


@pytest.mark.spec("META-4", "META-5")
@pytest.mark.parametrize("writers", [[0, 1], [0, 2], [0, 1, 2]])
def test_an_object_written_by_two_or_more_ranks_is_refused_naming_them(
    writers: list[int],
) -> None:
    plans: list[list[WriteItem]] = [[] for _ in range(3)]
    for r in writers:
        plans[r].append(_object("step"))
    md, problems = build_state_dict_metadata(plans)
    assert problems == [f"'step': written as bytes by several ranks {writers}"]
    assert isinstance(md["step"], BytesStorageMetadata)
    _, ok = build_state_dict_metadata([[_object("step")], [], []])
    assert ok == []


@st.composite
def valid_plans(draw: st.DrawFn) -> tuple[list[list[WriteItem]], dict[str, Any]]:
    """Valid plans: each tensor tiled along a random dim, chunks spread over ranks."""
    world = draw(st.integers(1, 3))
    rng = random.Random(draw(st.integers(0, 10**6)))
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    want: dict[str, Any] = {}
    for t in range(draw(st.integers(0, 4))):
        fqn = f"t{t}"
        ndim = rng.randint(1, 3)
        size = tuple(rng.randint(1, 4) for _ in range(ndim))
        d = rng.randrange(ndim)
        cuts = sorted({0, *(rng.randint(0, size[d]) for _ in range(2))} - {size[d]})
        ends = [*cuts[1:], size[d]]
        dtype = rng.choice([torch.float32, torch.int8, torch.bfloat16])
        chunks = []
        for a, b in zip(cuts, ends):
            off = tuple(a if i == d else 0 for i in range(ndim))
            sz = tuple(b - a if i == d else g for i, g in enumerate(size))
            plans[rng.randrange(world)].append(_tensor(fqn, off, sz, size, dtype))
            chunks.append((off, sz))
        want[fqn] = (dtype, size, sorted(chunks))
    for o in range(rng.randint(0, 2)):
        plans[rng.randrange(world)].append(_object(f"o{o}"))
        want[f"o{o}"] = None
    return plans, want


@pytest.mark.spec("META-1")
@given(valid_plans())
def test_valid_plans_record_every_chunk_once_with_dtype_and_shape(
    case: tuple[list[list[WriteItem]], dict[str, Any]],
) -> None:
    plans, want = case
    md, problems = build_state_dict_metadata(plans)
    assert problems == []
    assert set(md) == set(want)
    for fqn, w in want.items():
        entry = md[fqn]
        if w is None:
            assert isinstance(entry, BytesStorageMetadata)
            continue
        dtype, size, chunks = w
        assert isinstance(entry, TensorStorageMetadata)
        assert entry.properties.dtype == dtype and tuple(entry.size) == size
        got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        assert got == chunks


@pytest.mark.spec("META-3", "META-5")
@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 1), (1, 2), (2, 2)],  # the 2nd and 3rd overlap; the hole at 4 makes the volume 5
        [(0, 2), (2, 1), (2, 1), (4, 0)],  # the same chunk twice after a clean one, a hole at 3
        [(0, 1), (1, 1), (2, 2), (3, 1)],  # the 3rd and 4th overlap, the volume is 5
    ],
    ids=["later-pair", "repeat", "tail"],
)
def test_an_overlap_that_is_not_between_the_first_chunks_is_found(
    chunks: list[tuple[int, int]],
) -> None:
    plans = [[_tensor("w", (a,), (n,), (5,)) for a, n in chunks], [_tensor("v", (0,), (5,), (5,))]]
    _, problems = build_state_dict_metadata(plans)
    assert [k for _, k in map(_kind, problems)] == ["overlap"], problems
