"""Global metadata from the deduplicated plans, and its validation (spec/planning.md, META-*).

Every violation is collected, with its FQN and the ranks involved, and raised
once as :class:`PlanValidationError` (META-5).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import chain, compress
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

from refdcp.errors import ProblemsError

__all__ = ["PlanValidationError", "build_state_dict_metadata", "find_overlaps"]


class PlanValidationError(ProblemsError):
    """The global save plan is inconsistent; ``problems`` lists every violation (META-5)."""

    headline = "invalid global save plan"


def build_state_dict_metadata(
    plans: Sequence[Sequence[WriteItem]],
    chunkless: Mapping[str, tuple[TensorProperties, torch.Size]] | None = None,
) -> tuple[dict[str, STORAGE_TYPES], list[str]]:
    """``state_dict_metadata`` of the final plans, and every problem found (META-1..5).

    Items are grouped by FQN with C-level attribute extraction; the checks run
    vectorised (:func:`_vector_screen`) and only suspicious FQNs get the exact,
    worded per-tensor check, which then looks up the ranks involved.
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
    groups = _group(all_fqns, all_tds)
    problems: list[str] = []
    md: dict[str, STORAGE_TYPES] = {}
    for fqn, ranks in kinds.items():
        if fqn in groups:
            problems.append(
                f"{fqn!r}: a tensor on ranks {_ranks_of(plans, fqn, tensor=True)} "
                f"but bytes on ranks {ranks}"
            )
        elif len(ranks) > 1:
            problems.append(f"{fqn!r}: written as bytes by several ranks {ranks}")
        md[fqn] = BytesStorageMetadata()
    intern_props = _Interned()
    sizes: dict[torch.Size, torch.Size] = {}
    for fqn, tds in groups.items():
        first = tds[0]
        chunks = list(map(_chunk, tds))
        size = sizes.setdefault(first.size, first.size)
        for c in chunks:  # equal Size objects shared: pickled once (META-8)
            c.offsets = sizes.setdefault(c.offsets, c.offsets)
            c.sizes = sizes.setdefault(c.sizes, c.sizes)
        md[fqn] = TensorStorageMetadata(
            properties=intern_props(first.properties), size=size, chunks=chunks
        )
    for fqn, (props, size) in (chunkless or {}).items():
        if fqn not in md:
            md[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=[])
    tensors = {
        f: e for f, e in md.items() if isinstance(e, TensorStorageMetadata) and f not in kinds
    }
    mixed, suspects = _vector_screen(tensors, groups)
    for fqn in mixed:
        ranks = _ranks_of(plans, fqn, tensor=True)
        by: dict[Any, list[int]] = {}
        for td, r in zip(groups[fqn], ranks):
            by.setdefault((td.properties.dtype, tuple(td.size)), []).append(r)
        desc = "; ".join(
            f"ranks {sorted(set(rs))} say dtype {dt} and global shape {list(sz)}"
            for (dt, sz), rs in by.items()
        )
        problems.append(f"{fqn!r}: ranks disagree on dtype or global shape: {desc}")
    for fqn in suspects:
        entry = tensors[fqn]
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
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        return self._seen.setdefault(key, p)


def _group(fqns: list[str], values: list[Any]) -> dict[str, list[Any]]:
    """Group ``values`` by FQN, keeping plan order, with the per-item work in C."""
    if not fqns:
        return {}
    uniq = list(dict.fromkeys(fqns))
    index = dict(zip(uniq, range(len(uniq))))
    ids = np.fromiter(map(index.__getitem__, fqns), dtype=np.int64, count=len(fqns))
    order = np.argsort(ids, kind="stable")
    counts = np.bincount(ids, minlength=len(uniq))
    ordered = [values[i] for i in order.tolist()]
    ends = np.cumsum(counts).tolist()
    starts = [0, *ends[:-1]]
    return {f: ordered[a:b] for f, a, b in zip(uniq, starts, ends)}


_td = attrgetter("tensor_data")
_fqn = attrgetter("index.fqn")
_chunk = attrgetter("chunk")


def _ranks_of(plans: Sequence[Sequence[WriteItem]], fqn: str, *, tensor: bool) -> list[int]:
    """The rank of each of ``fqn``'s items, in plan order (only for error messages)."""
    return [
        r
        for r, items in enumerate(plans)
        for i in items
        if i.index.fqn == fqn and (i.tensor_data is not None) == tensor
    ]


def _vector_screen(
    tensors: Mapping[str, TensorStorageMetadata], groups: Mapping[str, list[Any]]
) -> tuple[list[str], list[str]]:
    """FQNs that may break META-2/META-3, found with numpy over all chunks at once.

    A tensor passes when its chunks are in bounds, their volumes sum to the
    tensor's, and, sorted along some dimension, each starts at or after the
    previous one's end (so no two overlap). Everything else gets the exact,
    slower per-tensor check, which also words the problems.
    """
    by_ndim: dict[int, list[str]] = {}
    for fqn, e in tensors.items():
        by_ndim.setdefault(len(e.size), []).append(fqn)
    suspects: list[str] = []
    mixed: list[str] = []
    get_off = attrgetter("offsets")
    get_size = attrgetter("sizes")
    for ndim, all_fqns in by_ndim.items():
        fqns, odd = _split_mixed(all_fqns, tensors, groups)
        mixed.extend(odd)
        if ndim == 0:
            suspects.extend(f for f in fqns if len(tensors[f].chunks) != 1)
            continue
        counts = np.fromiter(
            (len(tensors[f].chunks) for f in fqns), dtype=np.int64, count=len(fqns)
        )
        chunks = [c for f in fqns for c in tensors[f].chunks]
        n = len(chunks)
        off = np.array(list(chain.from_iterable(map(get_off, chunks))), dtype=np.int64)
        siz = np.array(list(chain.from_iterable(map(get_size, chunks))), dtype=np.int64)
        glob = np.array([tuple(tensors[f].size) for f in fqns], dtype=np.int64).reshape(-1, ndim)
        if off.size != n * ndim or siz.size != n * ndim:
            suspects.extend(fqns)  # a chunk of the wrong rank
            continue
        off = off.reshape(n, ndim)
        siz = siz.reshape(n, ndim)
        owner = np.repeat(np.arange(len(fqns)), counts)
        g = glob[owner]
        bad = ((off < 0) | (siz < 0) | (off + siz > g)).any(axis=1)
        vol = np.prod(siz, axis=1, dtype=np.int64)
        covered = np.zeros(len(fqns), dtype=np.int64)
        np.add.at(covered, owner, vol)
        bad_f = np.zeros(len(fqns), dtype=bool)
        np.logical_or.at(bad_f, owner, bad)
        bad_f |= covered != np.prod(glob, axis=1, dtype=np.int64)
        # disjoint along some dim: sort by (fqn, start), next start >= this end
        nonempty = vol > 0
        disjoint_any = np.zeros(len(fqns), dtype=bool)
        multi = np.bincount(owner[nonempty], minlength=len(fqns)) > 1
        for d in range(ndim):
            idx = np.flatnonzero(nonempty)
            order = idx[np.lexsort((off[idx, d], owner[idx]))]
            o, st, en = owner[order], off[order, d], off[order, d] + siz[order, d]
            same = o[1:] == o[:-1]
            clash = same & (st[1:] < en[:-1])
            clash_f = np.zeros(len(fqns), dtype=bool)
            np.logical_or.at(clash_f, o[1:], clash)
            disjoint_any |= ~clash_f
        bad_f |= multi & ~disjoint_any
        suspects.extend(fqns[i] for i in np.flatnonzero(bad_f))
    return mixed, suspects


_dtype = attrgetter("properties.dtype")
_gsize = attrgetter("size")


def _split_mixed(
    fqns: list[str], tensors: Mapping[str, TensorStorageMetadata], groups: Mapping[str, list[Any]]
) -> tuple[list[str], list[str]]:
    """(FQNs whose items agree on dtype and global shape, FQNs whose items do not) (META-4)."""
    tds = [groups.get(f, ()) for f in fqns]
    firsts = [t[0] for t in tds if t]
    if not firsts:
        return fqns, []
    flat = list(chain.from_iterable(tds))
    counts = np.fromiter(map(len, tds), dtype=np.int64, count=len(tds))
    owner = np.repeat(np.arange(len(fqns)), counts)
    first_idx = np.repeat(np.cumsum(counts) - counts, counts)
    ndim = len(tensors[fqns[0]].size)
    sizes = np.array(list(chain.from_iterable(map(_gsize, flat))), dtype=np.int64)
    if sizes.size == len(flat) * ndim:
        sizes = sizes.reshape(len(flat), ndim)
        same_size = (sizes == sizes[first_idx]).all(axis=1)
    else:  # some item has another rank: compare shapes one by one
        same_size = np.fromiter(
            (flat[i].size == flat[j].size for i, j in enumerate(first_idx.tolist())),
            dtype=bool,
            count=len(flat),
        )
    dts = list(map(_dtype, flat))
    code = {d: i for i, d in enumerate(dict.fromkeys(dts))}
    codes = np.fromiter(map(code.__getitem__, dts), dtype=np.int64, count=len(dts))
    same_dtype = codes == codes[first_idx]
    bad = np.zeros(len(fqns), dtype=bool)
    np.logical_or.at(bad, owner, ~(same_size & same_dtype))
    return [f for f, b in zip(fqns, bad) if not b], [f for f, b in zip(fqns, bad) if b]


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
