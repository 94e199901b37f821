"""The stored layout of a checkpoint, checked before a byte is read (FMT-28, FMT-29).

Two rules, each a pure function of the metadata (no I/O, no torch.distributed):

* **tiling** (FMT-28): a tensor key's stored chunks tile the tensor exactly:
  every chunk lies inside the tensor, and every element is in exactly one
  chunk (no hole, no overlap; a chunk listed twice is an overlap);
* **records** (FMT-29): every stored chunk (and every non-tensor key) has a
  storage record, and no two records share a byte of one file (their
  ``[offset, offset + length)`` ranges are disjoint within each file).

Violations raise :class:`MalformedMetadataError` naming the key and the chunks
(or the two records and the file). The fast versions are what loads and
``refdcp verify`` run; ``readable_tiling_problem`` and
``readable_record_problem`` state the same rules in the plainest quadratic
form, and the tests check that both versions agree.

How the fast tiling check works: the sum of the chunks' indicator functions
equals the tensor's indicator exactly when their signed corner counts agree
(each box ``[a, b)`` contributes ``+1`` or ``-1`` at each of its ``2**k``
corners, the sign being ``-1`` to the number of upper ends used; this mixed
difference determines the function). A sum of indicators that equals the
tensor's indicator covers every element exactly once and nothing outside.
Dimensions that every chunk spans whole are left out (``k`` counts only the
split ones), so the work is ``len(chunks) * 2**k``: linear for the usual one
or two split dimensions. The smallest corner (in row-major order) whose count
disagrees is an element covered the wrong number of times, which the error
names with the chunks that hold it. Layouts split along so many dimensions
that the corners would exceed a budget are checked by a sweep that tests
overlapping pairs instead (exact, quadratic in the worst case, capped).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from refdcp.storage.errors import MalformedMetadataError
from refdcp.storage.format import layout

__all__ = [
    "check_records",
    "check_stored_layout",
    "check_tiling",
    "readable_record_problem",
    "readable_tiling_problem",
    "record_problem",
    "storage_records",
    "tiling_problem",
]

#: most corners (chunks times 2**split dimensions) the corner count builds at once
CORNER_BUDGET = 1 << 23
#: most box comparisons the fallback sweep makes before refusing the layout as too
#: complex to check
SWEEP_BUDGET = 1 << 25
#: chunks named in one error at most
_NAMED = 4

Box = tuple[tuple[int, ...], tuple[int, ...]]
#: (who: a MetadataIndex or a name, file, offset, length) of one storage record
Record = tuple[object, str, int, int]


def _box(c: ChunkStorageMetadata) -> Box:
    return tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)


def _describe(boxes: Sequence[Box], which: Iterable[int]) -> str:
    picked = list(which)
    shown = [f"#{i} at {list(boxes[i][0])} sizes {list(boxes[i][1])}" for i in picked[:_NAMED]]
    more = f" and {len(picked) - _NAMED} more" if len(picked) > _NAMED else ""
    return ", ".join(shown) + more


def _out_of_range(size: tuple[int, ...], boxes: Sequence[Box]) -> str | None:
    for i, (off, n) in enumerate(boxes):
        if len(off) != len(size) or len(n) != len(size):
            return (
                f"chunk {_describe(boxes, [i])} does not have the tensor's {len(size)} dimensions"
            )
        if any(o < 0 or k < 0 or o + k > f for o, k, f in zip(off, n, size)):
            return f"chunk {_describe(boxes, [i])} is not inside the tensor of size {list(size)}"
    return None


def _holding(boxes: Sequence[Box], point: Sequence[int]) -> list[int]:
    return [
        i
        for i, (off, n) in enumerate(boxes)
        if all(o <= p < o + k for o, k, p in zip(off, n, point))
    ]


def _wrong_at(size: tuple[int, ...], boxes: Sequence[Box], point: Sequence[int]) -> str:
    held = _holding(boxes, point)
    if not held:
        return f"element {list(point)} is in no chunk (a hole)"
    return f"element {list(point)} is in {len(held)} chunks: {_describe(boxes, held)}"


# -- the readable forms -----------------------------------------------------------


def readable_tiling_problem(
    size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]
) -> str | None:
    """FMT-28 in its plainest form (quadratic): every chunk inside the tensor, no two
    chunks sharing an element, and the chunks' elements adding up to the tensor's."""
    full = tuple(int(x) for x in size)
    boxes = [_box(c) for c in chunks]
    bad = _out_of_range(full, boxes)
    if bad is not None:
        return bad
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (oi, ni), (oj, nj) = boxes[i], boxes[j]
            if all(max(a, b) < min(a + m, b + k) for a, m, b, k in zip(oi, ni, oj, nj)):
                return f"chunks {_describe(boxes, [i, j])} overlap"
    covered = sum(math.prod(n) for _, n in boxes)
    if covered != math.prod(full):
        return f"the chunks hold {covered} of the tensor's {math.prod(full)} elements (a hole)"
    return None


def readable_record_problem(records: Sequence[Record]) -> str | None:
    """FMT-29's byte rule in its plainest form (quadratic): no two ``(who, file, offset,
    length)`` records share a byte of one file."""
    for i in range(len(records)):
        for j in range(i + 1, len(records)):
            a, b = records[i], records[j]
            if a[1] == b[1] and max(a[2], b[2]) < min(a[2] + a[3], b[2] + b[3]):
                return _shared(a, b)
    return None


def _label(who: object) -> str:
    if isinstance(who, MetadataIndex):
        if who.offset is None:
            return repr(who.fqn)
        return f"{who.fqn!r} chunk at {list(who.offset)}"
    return str(who)


def _shared(a: Record, b: Record) -> str:
    return (
        f"{_label(a[0])} (bytes {a[2]}..{a[2] + a[3]}) and {_label(b[0])} (bytes {b[2]}..{b[2] + b[3]}) "
        f"share bytes of file {a[1]!r}"
    )


# -- the fast forms ----------------------------------------------------------------


def tiling_problem(size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``size`` exactly, or None (FMT-28); linear
    in the chunks for layouts split along few dimensions (see the module docstring)."""
    n = len(chunks)
    if n == 1:  # the common case: one chunk, the whole tensor
        only = chunks[0]
        same = tuple(only.sizes) == tuple(size) and len(only.offsets) == len(size)
        if same and not any(only.offsets):
            return None
    full = tuple(int(x) for x in size)
    if n == 0:
        return None if 0 in full else f"no chunks for a tensor of {math.prod(full)} elements"
    ndim = len(full)
    try:
        offs = _matrix(map(_offsets, chunks), n, ndim)
        lens = _matrix(map(_sizes, chunks), n, ndim)
    except (ValueError, OverflowError, TypeError):
        offs = lens = None  # ragged or beyond int64: the plain check names the chunk
    fulls = np.array(full, dtype=np.int64)
    if offs is None or lens is None or not _inside(offs, lens, fulls):
        boxes = [_box(c) for c in chunks]
        bad = _out_of_range(full, boxes)
        assert bad is not None
        return bad
    if 0 in full:
        return None  # inside an empty tensor, chunks hold no element to miss or share
    split = [d for d in range(ndim) if (offs[:, d] != 0).any() or (lens[:, d] != fulls[d]).any()]
    if n << len(split) <= CORNER_BUDGET:
        point = _corner_residue(offs[:, split], lens[:, split], fulls[split])
        if point is None:
            return None
        whole = [0] * len(full)
        for d, p in zip(split, point):
            whole[d] = p
        return _wrong_at(full, [_box(c) for c in chunks], whole)
    return _sweep(full, [_box(c) for c in chunks])


def _offsets(c: ChunkStorageMetadata) -> Any:
    return c.offsets


def _sizes(c: ChunkStorageMetadata) -> Any:
    return c.sizes


def _matrix(rows: Iterable[Sequence[int]], n: int, ndim: int) -> Any:
    """An (n, ndim) int64 array of ``rows``; ValueError when a row is not ``ndim`` long."""
    listed = list(rows)
    if any(len(r) != ndim for r in listed):
        raise ValueError("a row of another length")
    flat = np.fromiter(itertools.chain.from_iterable(listed), dtype=np.int64, count=n * ndim)
    return flat.reshape(n, ndim)


def _inside(offs: Any, lens: Any, full: Any) -> bool:
    if (offs < 0).any() or (lens < 0).any() or (offs > full).any() or (lens > full).any():
        return False
    return bool((offs + lens <= full).all())  # no overflow: each term is at most full


def _corner_residue(offs: Any, lens: Any, full: Any) -> list[int] | None:
    """The first (row-major) corner where the chunks' signed corner counts differ from
    the tensor's, or None when they agree everywhere (the chunks tile it exactly)."""
    n, k = offs.shape
    if k == 0:  # every chunk is the whole tensor: one is a tiling, more overlap
        return None if n == 1 else []
    bits = np.arange(1 << k, dtype=np.int64)
    upper = ((bits[:, None] >> np.arange(k, dtype=np.int64)[None, :]) & 1).astype(bool)  # (2^k, k)
    sign = np.where(upper.sum(axis=1) % 2 == 0, 1, -1).astype(np.int64)  # (2^k,)
    # the tensor's own corners with sign -1, so an exact tiling sums to zero everywhere
    box_off = np.concatenate([offs, np.zeros((1, k), dtype=np.int64)])
    box_end = np.concatenate([offs + lens, full[None, :]])
    weight = np.concatenate([np.ones(n, dtype=np.int64), np.array([-1], dtype=np.int64)])
    corners = np.where(upper[None, :, :], box_end[:, None, :], box_off[:, None, :])  # (n+1, 2^k, k)
    corners = corners.reshape(-1, k)
    signs = (weight[:, None] * sign[None, :]).reshape(-1)
    radix = full + 1
    if float(np.prod(radix.astype(np.float64))) < 2.0**62:
        strides = np.ones(k, dtype=np.int64)
        for d in range(k - 2, -1, -1):
            strides[d] = strides[d + 1] * radix[d + 1]
        keys = corners @ strides
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    else:
        order = np.lexsort(corners.T[::-1])
        rows = corners[order]
        starts = np.flatnonzero(np.r_[True, (rows[1:] != rows[:-1]).any(axis=1)])
    sums = np.add.reduceat(signs[order], starts)
    wrong = np.flatnonzero(sums)
    if wrong.size == 0:
        return None
    first = corners[order[starts[wrong[0]]]]
    return [int(x) for x in first]


def _sweep(full: tuple[int, ...], boxes: list[Box]) -> str | None:
    """Exact check for layouts split along many dimensions: no overlapping pair (a sweep
    along dimension 0) and the elements adding up; refuses past SWEEP_BUDGET comparisons."""
    nonempty = [i for i, (_, n) in enumerate(boxes) if all(k > 0 for k in n)]

    def span(i: int) -> tuple[int, int]:  # the box along dimension 0 (a scalar: [0, 1))
        off, n = boxes[i]
        return (off[0], off[0] + n[0]) if off else (0, 1)

    nonempty.sort(key=span)
    active: list[int] = []
    work = 0
    for i in nonempty:
        oi, ni = boxes[i]
        start = span(i)[0]
        active = [j for j in active if span(j)[1] > start]
        for j in active:
            work += 1
            oj, nj = boxes[j]
            if all(max(a, b) < min(a + m, b + k) for a, m, b, k in zip(oi, ni, oj, nj)):
                return f"chunks {_describe(boxes, [j, i])} overlap"
        if work > SWEEP_BUDGET:
            return (
                f"{len(boxes)} chunks split along {len(full)} dimensions: too complex to check "
                "that they tile the tensor"
            )
        active.append(i)
    covered = sum(math.prod(n) for _, n in boxes)
    if covered != math.prod(full):
        return f"the chunks hold {covered} of the tensor's {math.prod(full)} elements (a hole)"
    return None


def record_problem(records: Sequence[Record]) -> str | None:
    """Why two ``(who, file, offset, length)`` records share a byte of one file, or None
    (FMT-29); sorts by file and offset, so n log n."""
    pair = shared_pair([r[1] for r in records], [r[2] for r in records], [r[3] for r in records])
    return None if pair is None else _shared(records[pair[0]], records[pair[1]])


def shared_pair(
    files: Sequence[object], offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int] | None:
    """Indices of two records (parallel sequences) sharing a byte of one file, or None.

    Zero-length records hold no byte, so they share none; in (file, offset) order, a
    record that overlaps any earlier one of its file overlaps the one just before it.
    """
    n = len(files)
    ids: dict[object, int] = {}
    fid = np.fromiter((ids.setdefault(f, len(ids)) for f in files), dtype=np.int64, count=n)
    try:
        off = np.fromiter(offsets, dtype=np.int64, count=n)
        size = np.fromiter(lengths, dtype=np.int64, count=n)
    except (OverflowError, ValueError, TypeError):  # beyond int64: the plain sort
        plain = sorted(
            (i for i in range(n) if lengths[i] > 0),
            key=lambda i: (ids[files[i]], offsets[i]),
        )
        for p, q in itertools.pairwise(plain):
            if files[p] == files[q] and offsets[q] - offsets[p] < lengths[p]:
                return p, q
        return None
    held = np.flatnonzero(size > 0)
    order = held[np.lexsort((off[held], fid[held]))]
    a, b = order[:-1], order[1:]
    # same file, and the later one starts before the earlier one ends (no overflow:
    # both offsets are non-negative and b's is the larger)
    hit = np.flatnonzero((fid[a] == fid[b]) & (off[b] - off[a] < size[a]))
    if hit.size == 0:
        return None
    return int(a[hit[0]]), int(b[hit[0]])


# -- the checks a load and verify run ---------------------------------------------------


def check_tiling(
    metadata: Metadata, keys: Iterable[str] | None = None, *, file: str = layout.METADATA_NAME
) -> None:
    """Raise :class:`MalformedMetadataError` naming the first tensor key (of ``keys``, or
    all) whose stored chunks do not tile it exactly (FMT-28)."""
    sdm = metadata.state_dict_metadata
    for fqn in sdm if keys is None else keys:
        md = sdm.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        problem = tiling_problem(md.size, md.chunks)
        if problem is not None:
            raise MalformedMetadataError(
                f"the stored chunks do not tile the tensor: {problem}",
                field=f"state_dict_metadata[{fqn!r}].chunks",
                file=file,
            )


def check_records(
    metadata: Metadata, keys: Iterable[str] | None = None, *, file: str = layout.METADATA_NAME
) -> None:
    """Raise :class:`MalformedMetadataError` when a stored chunk or non-tensor key (of
    ``keys``, or all) has no storage record, or two records share bytes of a file (FMT-29)."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return
    sdm = metadata.state_dict_metadata
    indices = list(storage)
    located = set(zip(map(_fqn, indices), map(_offset, indices)))
    for fqn in sdm if keys is None else keys:
        md = sdm.get(fqn)
        if isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                if (fqn, c.offsets) not in located:
                    raise MalformedMetadataError(
                        f"chunk at {list(c.offsets)} has no storage record",
                        field=f"state_dict_metadata[{fqn!r}].chunks",
                        file=file,
                    )
        elif isinstance(md, BytesStorageMetadata) and (fqn, None) not in located:
            raise MalformedMetadataError(
                "no storage record", field=f"state_dict_metadata[{fqn!r}]", file=file
            )
    infos = list(storage.values())
    pair = shared_pair(list(map(_path, infos)), list(map(_start, infos)), list(map(_length, infos)))
    if pair is not None:
        records = [
            (indices[i], str(infos[i].relative_path), infos[i].offset, infos[i].length)
            for i in pair
        ]
        raise MalformedMetadataError(_shared(*records), field="storage_data", file=file)


_fqn = operator.attrgetter("fqn")
_offset = operator.attrgetter("offset")
_path = operator.attrgetter("relative_path")
_start = operator.attrgetter("offset")
_length = operator.attrgetter("length")


def storage_records(metadata: Metadata) -> list[Record]:
    """Every storage record of ``metadata`` as ``(index, file, offset, length)``."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        return []
    return [
        (index, str(info.relative_path), int(info.offset), int(info.length))
        for index, info in storage.items()
    ]


def check_stored_layout(metadata: Metadata, *, file: str = layout.METADATA_NAME) -> None:
    """Both rules over every key of the checkpoint (what ``refdcp verify`` runs)."""
    check_tiling(metadata, file=file)
    check_records(metadata, file=file)
