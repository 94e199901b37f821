"""The planner's vectorised metadata checks find what the plain reference finds (META-6, META-7)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
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


def kind_of(problem: str) -> tuple[str, str]:
    fqn = problem.split("'")[1]
    for words, kind in KINDS.items():
        if words in problem:
            return fqn, kind
    raise AssertionError(f"unclassified problem: {problem}")


def _tensor(
    fqn: str, off: tuple[int, ...], sz: tuple[int, ...], size: tuple[int, ...], dtype: torch.dtype
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
def global_plans(draw: st.DrawFn) -> tuple[list[list[WriteItem]], dict[str, Any]]:
    """Tilings of random tensors over ranks, some damaged: gaps, overlaps, strays, disagreements."""
    world = draw(st.integers(1, 4))
    rng = random.Random(draw(st.integers(0, 10**6)))
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    without_chunks: dict[str, Any] = {}
    for t in range(draw(st.integers(0, 6))):
        fqn = f"t{t}"
        if rng.random() < 0.15:
            for r in rng.sample(range(world), rng.randint(1, world)):
                plans[r].append(_object(fqn))
            if rng.random() < 0.5:
                continue
        ndim = rng.randint(0, 3)
        size = tuple(rng.randint(0, 5) for _ in range(ndim))
        if rng.random() < 0.1:
            without_chunks[fqn] = (TensorProperties(dtype=torch.float32), torch.Size(size))
            continue
        cuts = (
            sorted({0, *(rng.randint(0, size[0]) for _ in range(rng.randint(0, 3)))})
            if ndim
            else [0]
        )
        ends = [*cuts[1:], size[0] if ndim else 0]
        chunks = [
            ((a, *[0] * (ndim - 1)), (b - a, *size[1:])) if ndim else ((), ())
            for a, b in zip(cuts, ends)
        ]
        damage = rng.random()
        if damage < 0.1 and len(chunks) > 1:
            chunks.pop(rng.randrange(len(chunks)))  # a gap
        elif damage < 0.2 and chunks:
            chunks.append(rng.choice(chunks))  # the same chunk twice
        elif damage < 0.3 and chunks and ndim:
            off, sz = chunks[0]
            chunks[0] = (
                (off[0] + rng.choice([-1, 1, 2]), *off[1:]),
                sz,
            )  # shifted: overlap or outside
        elif damage < 0.35 and ndim:
            chunks.append(((0,) * (ndim + 1), (1,) * (ndim + 1)))  # a chunk of the wrong rank
        for off, sz in chunks:
            dtype, gsize = torch.float32, size
            if rng.random() < 0.05:
                dtype = torch.bfloat16  # a rank that disagrees on dtype
            elif rng.random() < 0.05:
                gsize = (*size, 1)  # or on global shape
            plans[rng.randrange(world)].append(_tensor(fqn, off, sz, gsize, dtype))
    return plans, without_chunks


@pytest.mark.spec("META-6")
@settings(max_examples=300)  # cheap examples; rare shapes need many
@given(global_plans())
def test_vectorised_checks_find_what_the_reference_finds(
    case: tuple[list[list[WriteItem]], dict[str, Any]],
) -> None:
    plans, without_chunks = case
    _, problems = build_state_dict_metadata(plans, without_chunks)
    assert {kind_of(p) for p in problems} == set(reference_metadata_problems(plans, without_chunks))


@pytest.mark.spec("META-7")
def test_the_reference_names_each_kind_of_problem() -> None:
    ok = [
        _tensor("w", (0,), (2,), (4,), torch.float32),
        _tensor("w", (2,), (2,), (4,), torch.float32),
    ]
    assert reference_metadata_problems([ok]) == []
    gap = [_tensor("w", (0,), (2,), (4,), torch.float32)]
    over = [*ok, _tensor("w", (1,), (2,), (4,), torch.float32)]
    out = [*ok, _tensor("w", (3,), (2,), (4,), torch.float32)]
    both = [[_object("o"), _tensor("o", (0,), (1,), (1,), torch.float32)]]
    mixed = [[ok[0]], [_tensor("w", (2,), (2,), (4,), torch.int64)]]
    assert reference_metadata_problems([gap]) == [("w", "cover")]
    assert reference_metadata_problems([over]) == [("w", "overlap"), ("w", "overlap")]
    assert reference_metadata_problems([out]) == [("w", "outside")]
    assert reference_metadata_problems(both) == [("o", "bytes")]
    assert reference_metadata_problems(mixed) == [("w", "disagree")]
