"""Resharding: read items that tile every target chunk from any saved chunk grid (RESHARD-*).

A sweep along one dimension (the one where the saved chunks have the most
distinct starts) pairs target and saved chunks; each overlapping pair gives
one read of their intersection (RESHARD-1, RESHARD-2).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

__all__ = ["read_items_for_chunks", "whole_tensor_read"]

_ZEROS: dict[int, torch.Size] = {}


def whole_tensor_read(fqn: str, saved: object) -> ReadItem | None:
    """The one read of a tensor saved as a single whole, non-empty chunk into a
    destination of the same shape (RESHARD-1); None for any other case.

    The same ReadItem as :func:`read_items_for_chunks` gives for one target
    chunk covering the tensor (the caller has checked the shapes match,
    POLICY-4); it covers the target exactly once (RESHARD-5) without the sweep.
    """
    if type(saved) is not TensorStorageMetadata or len(saved.chunks) != 1:
        return None
    chunk = saved.chunks[0]
    size = saved.size
    ndim = len(size)
    zeros = _ZEROS.get(ndim)
    if zeros is None:
        zeros = _ZEROS.setdefault(ndim, torch.Size([0] * ndim))
    if ndim == 0 or chunk.sizes != size or chunk.offsets != zeros or 0 in size:
        return None
    index = MetadataIndex(fqn, zeros, 0)  # immutable: the same key for both sides
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=zeros,
        storage_index=index,
        storage_offsets=zeros,
        lengths=size,
    )


def read_items_for_chunks(
    fqn: str, saved: TensorStorageMetadata, targets: Sequence[ChunkStorageMetadata]
) -> list[ReadItem]:
    """Reads that cover each non-empty target chunk exactly once (RESHARD-1..3).

    Offsets in a ReadItem are relative: ``dest_offsets`` to the target chunk,
    ``storage_offsets`` to the saved chunk. Empty chunks give no reads.
    """
    ndim = len(saved.size)
    out: list[ReadItem] = []
    if ndim == 0:
        for ti, t in enumerate(targets):
            out.append(_read(fqn, t.offsets, ti, saved.chunks[0].offsets, 0, (), (), ()))
        return out
    src = [
        (tuple(c.offsets), tuple(c.sizes), i)
        for i, c in enumerate(saved.chunks)
        if all(s > 0 for s in c.sizes)
    ]
    if not src:
        return out
    dim = max(range(ndim), key=lambda d: len({s[0][d] for s in src}))
    src.sort(key=lambda s: s[0][dim])
    starts = [s[0][dim] for s in src]
    reaching = _EndIndex([s[0][dim] + s[1][dim] for s in src])
    for ti, t in enumerate(targets):
        toff, tsz = tuple(t.offsets), tuple(t.sizes)
        if any(s <= 0 for s in tsz):
            continue
        lo_d, hi_d = toff[dim], toff[dim] + tsz[dim]
        # saved chunks starting before hi_d whose end passes lo_d: O(log n + hits)
        last = bisect.bisect_left(starts, hi_d)
        for j in reaching.indices_ending_after(lo_d, last):
            soff, ssz, si = src[j]
            lengths = []
            dest = []
            stor = []
            for a, n, b, m in zip(toff, tsz, soff, ssz):
                lo = a if a > b else b
                hi = min(a + n, b + m)
                if hi <= lo:
                    break
                lengths.append(hi - lo)
                dest.append(lo - a)
                stor.append(lo - b)
            else:
                out.append(_read(fqn, toff, ti, soff, si, dest, stor, lengths))
    return out


class _EndIndex:
    """A max-segment tree over chunk ends (chunks sorted by start) (RESHARD-6).

    ``indices_ending_after(x, last)`` lists, in order, the chunks among the
    first ``last`` whose end exceeds ``x``, visiting only subtrees that hold
    one, so one long chunk no longer makes every lookup scan all chunks.
    """

    def __init__(self, ends: list[int]) -> None:
        self.n = len(ends)
        size = 1
        while size < self.n:
            size *= 2
        self.size = size
        tree = [-1] * (2 * size)
        tree[size : size + self.n] = ends
        for i in range(size - 1, 0, -1):
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
        self.tree = tree
        self.visited = 0  # nodes popped by all lookups so far: the cost RESHARD-6 bounds

    def indices_ending_after(self, x: int, last: int) -> list[int]:
        out: list[int] = []
        tree, size = self.tree, self.size
        stack = [(1, 0, size)]  # node, first index it covers, one past its last
        while stack:
            node, lo, hi = stack.pop()
            self.visited += 1
            if lo >= last or tree[node] <= x:
                continue
            if node >= size:
                out.append(lo)
                continue
            mid = (lo + hi) // 2
            stack.append((2 * node + 1, mid, hi))
            stack.append((2 * node, lo, mid))
        return out


def _read(
    fqn: str,
    toff: Sequence[int],
    ti: int,
    soff: Sequence[int],
    si: int,
    dest: Sequence[int],
    stor: Sequence[int],
    lengths: Sequence[int],
) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, torch.Size(toff), ti),
        dest_offsets=torch.Size(dest),
        storage_index=MetadataIndex(fqn, torch.Size(soff), si),
        storage_offsets=torch.Size(stor),
        lengths=torch.Size(lengths),
    )
