"""Global metadata from the deduplicated plans, and its validation (spec/planning.md, META-*).

Every violation is collected, with its FQN and the ranks involved, and raised
once as :class:`PlanValidationError` (META-5).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem

from refdcp.planning.errors import PlanValidationError

from .dense_ids import DenseIds, IdArray, dense_ids, dense_ids_of_names

__all__ = ["PlanValidationError", "build_state_dict_metadata", "find_overlaps"]


def build_state_dict_metadata(
    plans: Sequence[Sequence[WriteItem]],
    without_chunks: Mapping[str, tuple[TensorProperties, torch.Size]] | None = None,
) -> tuple[dict[str, STORAGE_TYPES], list[str]]:
    """``state_dict_metadata`` of the final plans, and every problem found (META-1..5).

    Every per-item step is one C-level pass (``map`` over attribute getters
    and dict lookups) or numpy over integer ids of the distinct values
    (:class:`_Items`), so the cost grows linearly in the number of items; the
    checks run vectorised (:func:`_vector_screen`) and only suspicious FQNs get
    the exact, worded per-tensor check, which then looks up the ranks involved.
    """
    kinds: dict[str, list[int]] = {}  # FQN -> ranks that wrote it as bytes
    all_fqns: list[str] = []
    all_tds: list[Any] = []
    for rank, items in enumerate(plans):
        tds = list(map(_td, items))
        fqns = list(map(_fqn, items))
        if not all(tds):  # C-level test for a None (bytes item)
            for fqn, td in zip(fqns, tds):
                if td is None:
                    kinds.setdefault(fqn, []).append(rank)
            keep = [td is not None for td in tds]
            tds = list(compress(tds, keep))
            fqns = list(compress(fqns, keep))
        all_fqns.extend(fqns)
        all_tds.extend(tds)
    grouped = _Items(all_fqns, all_tds)
    del all_fqns, all_tds
    problems: list[str] = []
    md: dict[str, STORAGE_TYPES] = {}
    for fqn, ranks in kinds.items():
        if fqn in grouped.index:
            problems.append(
                f"{fqn!r}: a tensor on ranks {_ranks_of(plans, fqn, tensor=True)} "
                f"but bytes on ranks {ranks}"
            )
        elif len(ranks) > 1:
            problems.append(f"{fqn!r}: written as bytes by several ranks {ranks}")
        md[fqn] = BytesStorageMetadata()
    md.update(grouped.entries())  # equal values shared: pickled once (META-8)
    extra = [
        (fqn, TensorStorageMetadata(properties=props, size=size, chunks=[]))
        for fqn, (props, size) in (without_chunks or {}).items()
        if fqn not in md
    ]
    md.update(extra)
    mixed, suspects = _vector_screen(grouped, set(kinds), extra)
    for fqn in mixed:
        ranks = _ranks_of(plans, fqn, tensor=True)
        by: dict[Any, list[int]] = {}
        for td, r in zip(grouped.group(fqn), ranks):
            by.setdefault((td.properties.dtype, tuple(td.size)), []).append(r)
        desc = "; ".join(
            f"ranks {sorted(set(rs))} say dtype {dt} and global shape {list(sz)}"
            for (dt, sz), rs in by.items()
        )
        problems.append(f"{fqn!r}: ranks disagree on dtype or global shape: {desc}")
    for fqn in suspects:
        entry = md[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        problems.extend(_check_chunks(fqn, entry, _ranks_of(plans, fqn, tensor=True)))
    return md, problems


class _Interned:
    """One ``TensorProperties`` object per distinct value (META-8).

    ``pickle`` writes a shared object once and refers back to it, and
    ``TensorProperties`` pickles through a Python ``__getstate__``: sharing
    makes the ``.metadata`` of many small tensors smaller and faster to write.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], TensorProperties] = {}

    def __call__(self, p: TensorProperties) -> TensorProperties:
        return self._seen.setdefault(_props_key(p), p)

    def many(self, props: Iterable[TensorProperties]) -> list[TensorProperties]:
        """:meth:`__call__` over ``props``, in C (``map`` of ``dict.setdefault``)."""
        props = list(props)
        return list(map(self._seen.setdefault, map(_props_key, props), props))


_props_key = attrgetter("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class _Items:
    """The tensor items of a global plan grouped by FQN, as integer arrays (META-1..4).

    Items are grouped by FQN in plan order (FQNs in order of first appearance,
    then ranks in order): ``chunks`` in that order, ``starts``/``counts`` the
    segment of each FQN, ``owner`` each item's FQN. Global sizes, chunk offsets
    and chunk sizes become ids into one table of distinct values (``shapes``),
    dtypes ids into another, so every check is numpy over ``len(items)`` ints.
    Every attribute is read once, in C, in plan order (the objects' memory order).
    """

    def __init__(self, fqns: list[str], tds: list[Any]) -> None:
        n = len(tds)
        self.n = n
        self.index, fid = dense_ids_of_names(fqns)
        self.fqns: list[str] = list(self.index)
        nf = len(self.fqns)
        self.counts = np.bincount(fid, minlength=nf)
        self.starts = np.cumsum(self.counts) - self.counts
        self.owner = np.repeat(np.arange(nf, dtype=np.int32), self.counts)
        self.order: np.ndarray[Any, np.dtype[np.intp]] | None = None  # None: already grouped
        if n and not bool((fid[1:] >= fid[:-1]).all()):
            self.order = np.argsort(fid, kind="stable")
        del fid
        self._tds = tds
        chunks = list(map(_chunk, tds))
        offs = list(map(_offsets, chunks))
        sizes = list(map(_sizes, chunks))
        globs = list(map(_gsize, tds))
        self.shapes = DenseIds()
        self.glob = self._grouped(dense_ids(self.shapes, globs, n))  # first: a size equal to
        self.off = self._grouped(dense_ids(self.shapes, offs, n))  # a global size is usually
        self.size = self._grouped(dense_ids(self.shapes, sizes, n))  # shared with it, as before
        self.dtype = self._grouped(dense_ids(DenseIds(), map(_dtype, tds), n))
        all_sizes = _all_sizes(offs, sizes, globs)
        del offs, sizes, globs
        self.firsts = list(map(tds.__getitem__, self._positions(self.starts).tolist()))
        if all_sizes:  # one object per distinct value (META-8); which one does not matter
            canon = list(self.shapes)
            if self.order is None:
                ids_off, ids_size = self.off, self.size
            else:  # the ids in plan order, to match `chunks`
                ids_off, ids_size = np.empty_like(self.off), np.empty_like(self.size)
                ids_off[self.order] = self.off
                ids_size[self.order] = self.size
            set_off = map(canon.__getitem__, ids_off.tolist())
            deque(map(setattr, chunks, repeat("offsets"), set_off), maxlen=0)
            set_size = map(canon.__getitem__, ids_size.tolist())
            deque(map(setattr, chunks, repeat("sizes"), set_size), maxlen=0)
            self.canon_glob = [canon[g] for g in self.glob[self.starts].tolist()]
        self.chunks = chunks if self.order is None else _permuted(chunks, self.order)
        del chunks
        if not all_sizes:  # a tuple among the sizes: the first equal value in FQN order wins
            seen: dict[Any, Any] = {}
            self.canon_glob = []
            for f, first in enumerate(self.firsts):
                self.canon_glob.append(seen.setdefault(first.size, first.size))
                a = int(self.starts[f])
                for c in self.chunks[a : a + int(self.counts[f])]:
                    c.offsets = seen.setdefault(c.offsets, c.offsets)
                    c.sizes = seen.setdefault(c.sizes, c.sizes)

    def _grouped(self, a: IdArray) -> IdArray:
        return a if self.order is None else a[self.order]

    def _positions(self, grouped: np.ndarray[Any, np.dtype[np.intp]]) -> np.ndarray[Any, Any]:
        """Plan-order positions of the items at these grouped positions."""
        return grouped if self.order is None else self.order[grouped]

    def group(self, fqn: str) -> list[Any]:
        """The ``TensorWriteData`` of ``fqn``'s items, in plan order."""
        f = self.index[fqn]
        a = int(self.starts[f])
        where = self._positions(np.arange(a, a + int(self.counts[f])))
        return [self._tds[i] for i in where.tolist()]

    def entries(self) -> Iterator[tuple[str, TensorStorageMetadata]]:
        """``(fqn, TensorStorageMetadata)`` per FQN; equal values are one object (META-8)."""
        if not self.fqns:
            return iter(())
        props = _Interned().many(map(_props, self.firsts))
        if self.n == len(self.fqns):  # one chunk each
            chunk_lists: Iterable[list[Any]] = map(list, zip(self.chunks))
        else:
            ends = (self.starts + self.counts).tolist()
            chunk_lists = map(self.chunks.__getitem__, map(slice, self.starts.tolist(), ends))
        return zip(self.fqns, map(TensorStorageMetadata, props, self.canon_glob, chunk_lists))


def _permuted(values: list[Any], order: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
    out: list[Any] = np.fromiter(values, dtype=object, count=len(values))[order].tolist()
    return out


def _all_sizes(*lists: list[Any]) -> bool:
    return all({type(s) for s in values} <= {torch.Size} for values in lists)


_td = attrgetter("tensor_data")
_fqn = attrgetter("index.fqn")
_chunk = attrgetter("chunk")
_offsets = attrgetter("offsets")
_sizes = attrgetter("sizes")
_gsize = attrgetter("size")
_dtype = attrgetter("properties.dtype")
_props = attrgetter("properties")


def _ranks_of(plans: Sequence[Sequence[WriteItem]], fqn: str, *, tensor: bool) -> list[int]:
    """The rank of each of ``fqn``'s items, in plan order (only for error messages)."""
    return [
        r
        for r, items in enumerate(plans)
        for i in items
        if i.index.fqn == fqn and (i.tensor_data is not None) == tensor
    ]


def _vector_screen(
    items: _Items, skip: set[str], without_chunks: Sequence[tuple[str, TensorStorageMetadata]]
) -> tuple[list[str], list[str]]:
    """(FQNs whose ranks disagree on dtype or global shape, FQNs that may break META-2/3).

    All with numpy over every chunk at once. A tensor passes when its chunks
    are in bounds, their volumes sum to the tensor's, and, sorted along some
    dimension, each starts at or after the previous one's end (so no two
    overlap; slabs and grids pass in any plan order, META-9). Anything else
    gets the exact, slower per-tensor check, which also words the problems.
    FQNs in ``skip`` (also written as bytes) are not screened. The lists are
    ordered by the FQN's dimension count (first appearance), then by FQN.
    """
    nf = len(items.fqns)
    table = _Table(items.shapes)
    ndim_f = table.lens[items.glob[items.starts]] if nf else np.zeros(0, dtype=np.intp)
    mixed_f = _split_mixed(items)
    if skip:
        skipped = np.fromiter((f in skip for f in items.fqns), dtype=bool, count=nf)
        mixed_f &= ~skipped
    else:
        skipped = np.zeros(nf, dtype=bool)
    bad_f = _screen_chunks(items, table, ndim_f, ~(mixed_f | skipped))
    # a tensor no rank wrote a chunk of is fine only if it has no elements (and is not 0-d)
    extra_ndim = [len(e.size) for _, e in without_chunks]
    extra_bad = [not e.size or math.prod(e.size) != 0 for _, e in without_chunks]
    ndims = np.concatenate([ndim_f, np.array(extra_ndim, dtype=np.intp)])
    names = [*items.fqns, *(f for f, _ in without_chunks)]
    mixed_all = np.concatenate([mixed_f, np.zeros(len(without_chunks), dtype=bool)])
    bad_all = np.concatenate([bad_f, np.array(extra_bad, dtype=bool)])
    mixed: list[str] = []
    suspects: list[str] = []
    shown = ~np.concatenate([skipped, np.zeros(len(without_chunks), dtype=bool)])
    for d in dict.fromkeys(ndims[shown].tolist()):
        here = ndims == d
        mixed.extend(names[i] for i in np.flatnonzero(here & mixed_all).tolist())
        suspects.extend(names[i] for i in np.flatnonzero(here & bad_all).tolist())
    return mixed, suspects


class _Table:
    """The distinct shapes (global sizes, offsets, chunk sizes) as rows of one int64 array."""

    def __init__(self, shapes: Mapping[Any, int]) -> None:
        keys = list(shapes)
        u = len(keys)
        self.lens = np.fromiter(map(len, keys), dtype=np.intp, count=u)
        width = int(self.lens.max()) if u else 0
        flat = np.fromiter(chain.from_iterable(keys), dtype=np.int64, count=int(self.lens.sum()))
        if bool((self.lens == width).all()):
            self.values = flat.reshape(u, width)
        else:  # shapes of several lengths: pad each row with zeros
            self.values = np.zeros((u, width), dtype=np.int64)
            self.values[np.arange(width) < self.lens[:, None]] = flat


def _split_mixed(items: _Items) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Per FQN: do its items disagree with its first item on dtype or global shape? (META-4)"""
    nf = len(items.fqns)
    if not nf:
        return np.zeros(0, dtype=bool)
    firsts = items.starts[items.owner]
    odd = (items.glob != items.glob[firsts]) | (items.dtype != items.dtype[firsts])
    return np.bincount(items.owner[odd], minlength=nf) > 0


def _screen_chunks(
    items: _Items,
    table: _Table,
    ndim_f: np.ndarray[Any, np.dtype[np.intp]],
    active: np.ndarray[Any, np.dtype[np.bool_]],
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Per FQN: may its chunks break META-2/META-3? Only ``active`` FQNs are screened."""
    bad_f = np.zeros(len(items.fqns), dtype=bool)
    for d in np.unique(ndim_f[active]).tolist():
        fsel = active & (ndim_f == d)
        if d == 0:  # a 0-d tensor: exactly one chunk
            bad_f |= fsel & (items.counts != 1)
            continue
        if bool(fsel.all()):
            fidx = np.arange(len(items.fqns))
            oid, zid, owner = items.off, items.size, items.owner
        else:
            fidx = np.flatnonzero(fsel)
            idx = np.flatnonzero(fsel[items.owner])
            oid, zid = items.off[idx], items.size[idx]
            owner = np.repeat(np.arange(len(fidx)), items.counts[fidx])
        k = len(fidx)
        counts = items.counts[fidx]
        glob = table.values[items.glob[items.starts[fidx]], :d]
        off = table.values[oid, :d]
        siz = table.values[zid, :d]
        wrong = (table.lens[oid] != d) | (table.lens[zid] != d)  # a chunk of another rank
        outside = wrong | ((off < 0) | (siz < 0) | (off + siz > glob[owner])).any(axis=1)
        vol = np.prod(siz, axis=1, dtype=np.int64)
        covered = np.add.reduceat(vol, np.cumsum(counts) - counts)
        bad = np.bincount(owner[outside], minlength=k) > 0
        bad |= covered != np.prod(glob, axis=1, dtype=np.int64)
        nonempty = vol > 0
        bad |= ~_disjoint(owner[nonempty], off[nonempty], siz[nonempty], k)
        bad_f[fidx] |= bad
    return bad_f


def _disjoint(
    owner: np.ndarray[Any, Any], off: np.ndarray[Any, Any], siz: np.ndarray[Any, Any], k: int
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Per FQN: are its non-empty chunks provably pairwise disjoint? (META-3 screen)

    A sufficient test, per rotation of the dimensions (``d``, ``d+1``, ...):
    sorted by (start, end) along those dimensions in turn, each chunk and the
    next lie in one slab along the first few of them and, along the next, the
    next starts at or after this one's end. Chunks that pass are disjoint:
    slabs of rows, of columns and grids of tiles pass; the rest get the exact
    check. Chunks in plan order are tried first; only what fails is sorted.
    """
    ok = np.bincount(owner, minlength=k) <= 1
    if bool(ok.all()):
        return ok
    ndim = off.shape[1]
    end = off + siz
    for sort in (False, True):
        for d in range(ndim):
            sel = np.flatnonzero(~ok[owner])
            if not len(sel):
                return ok
            dims = [(d + j) % ndim for j in range(ndim)]
            if sort:  # by owner, then (start, end) along the dims in turn
                keys = [x for j in reversed(dims) for x in (end[sel, j], off[sel, j])]
                sel = sel[np.lexsort((*keys, owner[sel]))]
            o = owner[sel]
            pair_ok = np.zeros(len(sel) - 1, dtype=bool)
            prefix = np.ones(len(sel) - 1, dtype=bool)
            for j in dims:
                st, en = off[sel, j], end[sel, j]
                pair_ok |= prefix & (st[1:] >= en[:-1])
                prefix &= (st[1:] == st[:-1]) & (en[1:] == en[:-1])
            fine = np.ones(k, dtype=bool)
            fine[o[1:][(o[1:] == o[:-1]) & ~pair_ok]] = False
            ok |= fine  # every FQN not yet passed has all its chunks in `sel`
    return ok


Box = tuple[tuple[int, ...], tuple[int, ...], int]


def _check_chunks(fqn: str, md: TensorStorageMetadata, ranks: list[int]) -> list[str]:
    """In bounds, no overlap, exact cover: at every world size (META-2, META-3)."""
    size = tuple(md.size)
    ndim = len(size)
    chunks = md.chunks
    problems = []
    if ndim == 0:
        if len(chunks) != 1:
            problems.append(
                f"{fqn!r}: a 0-d tensor needs exactly one chunk, got {len(chunks)} from ranks {ranks}"
            )
        return problems
    total = 0
    boxes: list[Box] = []
    for chunk, rank in zip(chunks, ranks):
        off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
        if (
            len(off) != ndim
            or len(sz) != ndim
            or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, sz, size))
        ):
            problems.append(
                f"{fqn!r}: chunk at offsets {list(off)} sizes {list(sz)} from rank {rank} "
                f"lies outside the global shape {list(size)}"
            )
            continue
        vol = math.prod(sz)
        total += vol
        if vol:
            boxes.append((off, sz, rank))
    overlaps = find_overlaps(boxes)
    for a, b in overlaps[:20]:
        problems.append(
            f"{fqn!r}: chunk at {list(a[0])} sizes {list(a[1])} from rank {a[2]} overlaps "
            f"chunk at {list(b[0])} sizes {list(b[1])} from rank {b[2]}"
        )
    if len(overlaps) > 20:
        problems.append(f"{fqn!r}: {len(overlaps) - 20} more overlapping chunk pairs")
    if not problems and total != math.prod(size):
        problems.append(
            f"{fqn!r}: chunks from ranks {sorted(set(ranks))} cover {total} of "
            f"{math.prod(size)} elements of global shape {list(size)}"
        )
    return problems


def find_overlaps(boxes: list[Box]) -> list[tuple[Box, Box]]:
    """Pairs of overlapping non-empty boxes, by a sweep along the dim with most distinct starts (META-3)."""
    if len(boxes) < 2:
        return []
    ndim = len(boxes[0][0])
    if ndim == 1:
        return _sweep_1d(sorted(boxes))
    dim = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    order = sorted(boxes, key=lambda b: b[0][dim])
    active: list[Box] = []
    found: list[tuple[Box, Box]] = []
    for box in order:
        start = box[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > start]
        for a in active:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a[0], a[1], box[0], box[1])):
                found.append((a, box))
        active.append(box)
    return found


def _sweep_1d(boxes: list[Box]) -> list[tuple[Box, Box]]:
    """1-D boxes sorted by start overlap iff one starts before the furthest end so far."""
    found: list[tuple[Box, Box]] = []
    end = -1
    prev: Box | None = None
    for b in boxes:
        if prev is not None and b[0][0] < end:
            found.append((prev, b))
        if b[0][0] + b[1][0] > end:
            end, prev = b[0][0] + b[1][0], b
    return found
