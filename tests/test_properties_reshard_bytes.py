"""Resharding as a byte-provenance property (RESHARD-1, RESHARD-2).

Every element of the global tensor carries its own global index as its value;
the saved chunks are slices of it. Executing the planned reads on raw bytes must
leave every destination byte written exactly once, with the byte of the saved
element at the same global index. A planner that shifts one destination row
fails it (test_shifted_destination_row_is_caught).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

import refdcp.planning.resharding as resharding
from refdcp.planning.resharding import read_items_for_chunks

Box = tuple[tuple[int, ...], tuple[int, ...]]
Planner = Callable[[str, TensorStorageMetadata, Sequence[ChunkStorageMetadata]], list[ReadItem]]


def tiling(shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    per_dim = []
    for g in shape:
        cuts = sorted(rng.randint(0, g) for _ in range(rng.randint(0, 3)))
        edges = [0, *cuts, g]
        per_dim.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    boxes: list[Box] = [((), ())]
    for parts in per_dim:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in parts]
    return boxes


def region(a: np.ndarray, off: Sequence[int], size: Sequence[int]) -> np.ndarray:
    return a[tuple(slice(o, o + n) for o, n in zip(off, size))]


def check_provenance(
    shape: tuple[int, ...],
    saved: list[Box],
    targets: list[Box],
    plan: Planner = read_items_for_chunks,
) -> None:
    """Run ``plan``'s reads on bytes; every destination byte must come from exactly one
    saved byte at the same global index (RESHARD-1, RESHARD-2)."""
    itemsize = 8
    glob = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    gbytes = glob.view(np.uint8).reshape((*shape, itemsize)) if shape else glob.view(np.uint8)
    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.int64),
        size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in saved],
    )
    tmd = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in targets]
    src = [region(gbytes, o, s).copy() for o, s in saved]
    dest = [np.zeros((*s, itemsize), dtype=np.uint8) for _, s in targets]
    writes = [np.zeros(s, dtype=np.int64) for _, s in targets]
    for r in plan("x", md, tmd):
        ti, si = r.dest_index.index, r.storage_index.index
        assert ti is not None and si is not None
        assert tuple(r.dest_index.offset or ()) == targets[ti][0], "dest_index names another chunk"
        assert tuple(r.storage_index.offset or ()) == saved[si][0], (
            "storage_index names another chunk"
        )
        s_blk = region(src[si], r.storage_offsets, r.lengths)
        d_blk = region(dest[ti], r.dest_offsets, r.lengths)
        w_blk = region(writes[ti], r.dest_offsets, r.lengths)
        assert s_blk.shape == d_blk.shape == (*r.lengths, itemsize), f"read outside a chunk: {r}"
        d_blk[...] = s_blk
        w_blk += 1
    for (off, size), got, w in zip(targets, dest, writes):
        if math.prod(size) == 0:
            continue
        assert (w == 1).all(), f"target {off}+{size}: bytes written {w.tolist()} times"
        want = region(gbytes, off, size)
        bad = np.argwhere((got != want).any(axis=-1))
        assert bad.size == 0, (
            f"target {off}+{size}: element {bad[0].tolist()} holds saved global index "
            f"{int(got[tuple(bad[0])].view(np.int64)[0])}, wants {int(want[tuple(bad[0])].view(np.int64)[0])}"
        )


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], list[Box]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    return shape, tiling(shape, rng), tiling(shape, rng)


@pytest.mark.spec("RESHARD-1", "RESHARD-2")
@given(cases())
def test_every_destination_byte_comes_from_the_saved_byte_at_its_global_index(
    case: tuple[tuple[int, ...], list[Box], list[Box]],
) -> None:
    check_provenance(*case)


@pytest.mark.spec("RESHARD-1", "RESHARD-2")
def test_row_split_onto_column_split() -> None:
    # saved by rows (2 chunks), loaded by columns (3 chunks), and one long row chunk among short ones
    check_provenance(
        (4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))], [((0, 0), (4, 2)), ((0, 2), (4, 4))]
    )
    saved = [((0, 0), (1, 6))] + [((1, c), (3, 1)) for c in range(6)]
    check_provenance((4, 6), saved, [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6))])


@pytest.mark.spec("RESHARD-3", "RESHARD-1")
def test_empty_targets_and_saved_chunks_take_no_bytes() -> None:
    check_provenance((3, 0), [((0, 0), (3, 0))], [((0, 0), (3, 0))])
    check_provenance((4,), [((0,), (0,)), ((0,), (4,)), ((4,), (0,))], [((0,), (4,)), ((4,), (0,))])


@pytest.mark.spec("HARN-11", "RESHARD-1")
def test_shifted_destination_row_is_caught() -> None:
    """The deliberately wrong rule of issue 13 (one destination row shifted) fails the property."""
    shape, saved, targets = (4, 3), [((0, 0), (2, 3)), ((2, 0), (2, 3))], [((0, 0), (4, 3))]
    check_provenance(shape, saved, targets)  # the real planner passes

    def shifted(
        fqn: str, md: TensorStorageMetadata, t: Sequence[ChunkStorageMetadata]
    ) -> list[ReadItem]:
        reads = read_items_for_chunks(fqn, md, t)
        r = reads[-1]  # the second saved chunk's rows land one row too high
        reads[-1] = resharding._read(
            fqn,
            r.dest_index.offset or (),
            r.dest_index.index or 0,
            r.storage_index.offset or (),
            r.storage_index.index or 0,
            [r.dest_offsets[0] - 1, *r.dest_offsets[1:]],
            list(r.storage_offsets),
            list(r.lengths),
        )
        return reads

    with pytest.raises(AssertionError, match="written"):
        check_provenance(shape, saved, targets, shifted)
    # and one shifted by a whole row inside its own range: values wrong, coverage right
    one = [((0, 0), (1, 3)), ((1, 0), (1, 3)), ((2, 0), (2, 3))]

    def swapped(
        fqn: str, md: TensorStorageMetadata, t: Sequence[ChunkStorageMetadata]
    ) -> list[ReadItem]:
        reads = read_items_for_chunks(fqn, md, t)
        a, b = reads[0], reads[1]  # rows 0 and 1 trade destinations
        return [
            resharding._read(
                fqn,
                a.dest_index.offset or (),
                0,
                a.storage_index.offset or (),
                a.storage_index.index or 0,
                list(b.dest_offsets),
                list(a.storage_offsets),
                list(a.lengths),
            ),
            resharding._read(
                fqn,
                b.dest_index.offset or (),
                0,
                b.storage_index.offset or (),
                b.storage_index.index or 0,
                list(a.dest_offsets),
                list(b.storage_offsets),
                list(b.lengths),
            ),
            *reads[2:],
        ]

    check_provenance(shape, one, targets)
    with pytest.raises(AssertionError, match="holds saved global index"):
        check_provenance(shape, one, targets, swapped)
