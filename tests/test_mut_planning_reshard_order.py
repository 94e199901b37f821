"""Resharding reads from saved chunks listed in any order (RESHARD-1, RESHARD-2).

The metadata lists a tensor's saved chunks in the order the ranks wrote them, which
need not be sorted along any dimension; the sweep sorts them itself. Each target
chunk's reads must cover it exactly once and read only inside saved chunks, counted
element by element.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.planning.resharding import read_items_for_chunks


def _cuts(draw: st.DrawFn, n: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, n - 1), max_size=3, unique=True)) if n > 1 else []
    return [0, *sorted(inner), n]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[ChunkStorageMetadata], list[Any]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))
    cuts = [_cuts(draw, n) for n in shape]
    saved = [
        ChunkStorageMetadata(
            torch.Size([c[i] for c, i in zip(cuts, idx)]),
            torch.Size([c[i + 1] - c[i] for c, i in zip(cuts, idx)]),
        )
        for idx in itertools.product(*(range(len(c) - 1) for c in cuts))
    ]
    saved = draw(st.permutations(saved))
    targets = []
    for _ in range(draw(st.integers(1, 3))):
        off = [draw(st.integers(0, n - 1)) for n in shape]
        sz = [draw(st.integers(1, n - o)) for o, n in zip(off, shape)]
        targets.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
    return shape, saved, targets


@pytest.mark.spec("RESHARD-1", "RESHARD-2")
@settings(max_examples=200)  # cheap examples
@given(_layouts())
def test_every_target_element_is_read_once_from_chunks_in_any_order(
    case: tuple[tuple[int, ...], list[ChunkStorageMetadata], list[ChunkStorageMetadata]],
) -> None:
    shape, saved, targets = case
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), saved)
    reads = read_items_for_chunks("w", md, targets)
    by_offset = {tuple(c.offsets): c for c in saved}
    count = [torch.zeros(tuple(t.sizes), dtype=torch.int64) for t in targets]
    for r in reads:
        ti = r.dest_index.index
        assert ti is not None and tuple(r.dest_index.offset) == tuple(targets[ti].offsets)
        chunk = by_offset[tuple(r.storage_index.offset)]
        region = tuple(slice(o, o + n) for o, n in zip(r.dest_offsets, r.lengths))
        count[ti][region] += 1
        for d in range(len(shape)):  # the read lies inside its saved chunk, at the same place
            lo = r.storage_offsets[d] + chunk.offsets[d]
            assert (
                r.storage_offsets[d] >= 0 and lo + r.lengths[d] <= chunk.offsets[d] + chunk.sizes[d]
            )
            assert lo == targets[ti].offsets[d] + r.dest_offsets[d]
    for c in count:
        assert bool((c == 1).all())
