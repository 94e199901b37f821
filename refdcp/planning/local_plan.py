"""Local save plans: one write item per chunk this rank could write (PLAN-1, PLAN-2, PLAN-6..8).

Pure functions over a flattened state dict; no storage, no process group.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import attrgetter
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from refdcp.crc.kernel import crc32c, crc32c_small
from refdcp.crc.pieces import (
    EACH_SHARE_MIN_BYTES,
    HELPER_PIECE_BYTES,
    TwoEnds,
    crc32c_pieces,
    helpers_if_cpu_free,
)
from refdcp.storage.format.items import raw_view, value_digest_seed
from refdcp.storage.format.records import fields_are

__all__ = [
    "BLOCK_SPACING",
    "Blocks",
    "ItemKey",
    "block_digests",
    "chunk_nbytes",
    "tensors_without_chunks",
    "item_key",
    "may_be_replicated",
    "object_write_items",
    "PlanShare",
    "plain_tensor_item",
    "plan_and_block_digests",
    "plan_digest",
    "replica_checksums",
    "save_items",
    "tensor_checksum",
]

#: (fqn, chunk offsets) for tensors, (fqn, None) for bytes: what dedup groups by.
ItemKey = tuple[str, "torch.Size | None"]


def item_key(item: WriteItem) -> ItemKey:
    return (item.index.fqn, item.index.offset)


def object_write_items(fqn: str, obj: object) -> list[WriteItem]:
    """The write items of one flattened value (PLAN-1, PLAN-2)."""
    if type(obj) in _PLAIN_TENSORS:
        return [plain_tensor_item(fqn, obj)]  # type: ignore[arg-type]
    if isinstance(obj, DTensor):
        if any(p.is_partial() for p in obj.placements):
            raise ValueError(
                f"{fqn!r} is a DTensor with a Partial placement {obj.placements}; "
                "reduce it (e.g. redistribute to Replicate) before checkpointing"
            )
        if obj.device_mesh.get_coordinate() is None:
            return []
    create = getattr(obj, "__create_write_items__", None)
    if create is not None:
        items: list[WriteItem] = create(fqn, obj)
        return [i for i in items if not _empty_shard(i)]
    if isinstance(obj, ShardedTensor):
        out = []
        for shard in obj.local_shards():
            if shard.tensor.numel() == 0:
                continue
            off = torch.Size(shard.metadata.shard_offsets)
            out.append(
                WriteItem(
                    index=MetadataIndex(fqn, off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=off, sizes=torch.Size(shard.metadata.shard_sizes)
                        ),
                        properties=TensorProperties.create_from_tensor(shard.tensor),
                        size=obj.size(),
                    ),
                )
            )
        return out
    if isinstance(obj, torch.Tensor):
        off = torch.Size([0] * obj.dim())
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=obj.size()),
                    properties=TensorProperties.create_from_tensor(obj),
                    size=obj.size(),
                ),
            )
        ]
    return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_FQN = attrgetter("index.fqn")
_new = object.__new__
_set = object.__setattr__
_TENSOR = WriteItemType.TENSOR
_ZERO_OFFSETS: dict[int, torch.Size] = {}


#: the fast path builds torch's records by setting their fields (frozen dataclasses refuse
#: ``setattr``); it is used only while the installed torch's classes are the ones it knows
_FAST_RECORDS = (
    fields_are(MetadataIndex, ("fqn", "offset", "index"))
    and fields_are(ChunkStorageMetadata, ("offsets", "sizes"))
    and fields_are(TensorWriteData, ("chunk", "properties", "size"))
    and fields_are(WriteItem, ("index", "type", "bytes_io_data", "tensor_data"))
)


def _zero_offset(dim: int) -> torch.Size:
    off = _ZERO_OFFSETS.get(dim)
    if off is None:
        off = _ZERO_OFFSETS[dim] = torch.Size([0] * dim)
    return off


def _properties(t: torch.Tensor, memo: dict[tuple[Any, ...], TensorProperties]) -> TensorProperties:
    """``TensorProperties.create_from_tensor(t)``, one shared object per distinct value in one
    plan (META-8). The memo lives as long as one plan: nothing of one save reaches the next
    (a user may change the records a save returned, API-26)."""
    key = (t.dtype, t.layout, t.requires_grad, t.is_pinned())
    props = memo.get(key)
    if props is None:
        props = memo[key] = TensorProperties.create_from_tensor(t)
    return props


@dataclass
class PlanShare:
    """Objects the items of one plan share (META-8): properties, and whole-tensor write data."""

    properties: dict[tuple[Any, ...], TensorProperties] = field(default_factory=dict)
    data: dict[tuple[int, torch.Size], TensorWriteData] = field(default_factory=dict)


def plain_tensor_item(fqn: str, t: torch.Tensor, shared: PlanShare | None = None) -> WriteItem:
    """The TENSOR item of a plain tensor (PLAN-1): equal to the one torch's constructors build.

    Equal values share objects (the zero offsets, the properties; META-8), so
    the pickled ``.metadata`` stores them once. With ``shared`` (one for the
    items of one plan), items of equal dtype, properties and shape also share
    one ``TensorWriteData`` and so one whole-tensor chunk (META-8).
    """
    size = t.size()
    off = _zero_offset(len(size))
    props = _properties(t, shared.properties if shared is not None else {})
    if not _FAST_RECORDS:
        chunk = ChunkStorageMetadata(offsets=off, sizes=size)
        index = MetadataIndex(fqn, off)
        _set(index, "offset", off)  # torch's constructor copies it; keep the shared one
        data = TensorWriteData(chunk=chunk, properties=props, size=size)
        return WriteItem(index=index, type=_TENSOR, tensor_data=data)
    key = (id(props), size)  # props: one object per value, kept alive by the plan's share
    found = None if shared is None else shared.data.get(key)
    if found is None:
        chunk = _new(ChunkStorageMetadata)
        _set(chunk, "__dict__", {"offsets": off, "sizes": size})
        found = _new(TensorWriteData)
        _set(found, "__dict__", {"chunk": chunk, "properties": props, "size": size})
        if shared is not None:
            shared.data[key] = found
    index = _new(MetadataIndex)
    _set(index, "__dict__", {"fqn": fqn, "index": None, "offset": off})  # torch's field order
    item = _new(WriteItem)
    _set(
        item,
        "__dict__",
        {"index": index, "type": _TENSOR, "bytes_io_data": None, "tensor_data": found},
    )
    return item


def _empty_shard(item: WriteItem) -> bool:
    td = item.tensor_data
    return item.type == WriteItemType.SHARD and td is not None and 0 in td.chunk.sizes


def tensors_without_chunks(
    flat: Mapping[str, Any], items: Iterable[WriteItem]
) -> dict[str, tuple[TensorProperties, torch.Size]]:
    """Sharded values for which this rank plans no chunk: their dtype and global shape (META-1)."""
    planned = set(map(_FQN, items))  # in C
    out: dict[str, tuple[TensorProperties, torch.Size]] = {}
    for fqn in filterfalse(planned.__contains__, flat):  # in C: usually none is left
        obj = flat[fqn]
        if not isinstance(obj, (torch.Tensor, ShardedTensor)):
            continue
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        dtype = getattr(obj, "dtype", None)
        if isinstance(dtype, torch.dtype):
            out[fqn] = (TensorProperties(dtype=dtype), torch.Size(obj.size()))
    return out


def save_items(flat: Mapping[str, Any]) -> list[WriteItem]:
    """All write items of a flattened state dict, in key order (PLAN-1)."""
    items: list[WriteItem] = []
    append, extend = items.append, items.extend
    shared = PlanShare()  # one object per value (META-8)
    for fqn, obj in flat.items():
        if type(obj) in _PLAIN_TENSORS:
            append(plain_tensor_item(fqn, obj, shared))
        else:
            extend(object_write_items(fqn, obj))
    return items


def chunk_nbytes(item: WriteItem) -> int:
    """Bytes of the item's CHUNK (not the global tensor, unlike torch); 1 for bytes (DEDUP-3)."""
    td = item.tensor_data
    if td is None:
        return 1
    return math.prod(td.chunk.sizes) * _itemsize(td.properties.dtype)


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _signature(item: WriteItem) -> tuple[Any, ...]:
    td = item.tensor_data
    if td is None:
        return (item.index.fqn, None, item.type.value)
    return (
        item.index.fqn,
        tuple(item.index.offset or ()),
        item.type.value,
        tuple(td.chunk.sizes),
        str(td.properties.dtype),
        tuple(td.size),
    )


#: repr of ``_signature(item)[2:]`` (type, chunk sizes, dtype, global size) by their objects
_SIG_TAILS: dict[tuple[Any, ...], str] = {}


def _signature_repr(item: WriteItem) -> str:
    """``repr(_signature(item))``, the parts shared by many items formatted once."""
    td = item.tensor_data
    if td is None:
        return repr(_signature(item))
    offset = item.index.offset
    key = (item.type, td.chunk.sizes, td.properties.dtype, td.size, offset)
    tail = _SIG_TAILS.get(key)
    if tail is None:
        sig = _signature(item)
        tail = repr(sig[1:])[1:]  # "offset, type, sizes, dtype, size)"
        if len(_SIG_TAILS) > 4096:
            _SIG_TAILS.clear()
        _SIG_TAILS[key] = tail
    return f"({item.index.fqn!r}, {tail}"


def plan_digest(items: Iterable[WriteItem], checksums: Mapping[Any, int] | None = None) -> str:
    """A digest of the items' keys, shapes, dtypes (and value checksums): equal plans, equal digests.

    The digested text is ``repr([_signature(i) for i in items])``.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(("[" + ", ".join(map(_signature_repr, items)) + "]").encode())
    if checksums:
        h.update(repr(sorted(checksums.items(), key=repr)).encode())
    return h.hexdigest()


#: a block ends after an item whose FQN's crc32 is 0 modulo this: blocks of ~64 items on average
BLOCK_SPACING = 64

#: a plan cut into blocks: the end (exclusive item index) and digest of each block, in order
Blocks = tuple[list[int], list[bytes]]


def block_digests(
    items: list[WriteItem],
    checksums: Mapping[Any, int] | None = None,
    ends: list[int] | None = None,
) -> Blocks:
    """The plan cut where the content says, each block digested (PLAN-15, DEDUP-14).

    A block ends after each item whose FQN's crc32 is 0 modulo :data:`BLOCK_SPACING`
    (and at the plan's end), so the same run of items is cut the same way on every
    rank and in every process, wherever it sits in the plan: ranks whose plans differ
    in a few items still send equal digests for the blocks they share. A block's
    digest covers its items' signatures (as :func:`plan_digest`) and, when
    ``checksums`` are given, each item's checksum (``None`` where it has none).
    ``ends`` digests another cut instead (tests: any cut gives the same dedup).
    """
    return _blocks(items, list(map(_signature_repr, items)), checksums, ends)


def plan_and_block_digests(
    items: list[WriteItem], checksums: Mapping[Any, int] | None = None
) -> tuple[str, Blocks]:
    """:func:`plan_digest` and :func:`block_digests` of one plan, its signatures formatted once."""
    reprs = list(map(_signature_repr, items))
    h = hashlib.blake2b(digest_size=16)
    h.update(("[" + ", ".join(reprs) + "]").encode())
    if checksums:
        h.update(repr(sorted(checksums.items(), key=repr)).encode())
    return h.hexdigest(), _blocks(items, reprs, checksums, None)


def _blocks(
    items: list[WriteItem],
    reprs: list[str],
    checksums: Mapping[Any, int] | None,
    ends: list[int] | None,
) -> Blocks:
    if not items:
        return [], []
    fqns = list(map(_fqn_of, items))
    if ends is not None:
        cuts = list(ends)
    else:
        crcs = map(zlib.crc32, map(str.encode, fqns))
        cuts = [i + 1 for i, c in enumerate(crcs) if not c % BLOCK_SPACING]
        if not cuts or cuts[-1] != len(items):
            cuts.append(len(items))
    keys = list(zip(fqns, map(_offset_of, items))) if checksums is not None else []
    digests: list[bytes] = []
    start = 0
    for end in cuts:
        h = hashlib.blake2b(", ".join(reprs[start:end]).encode(), digest_size=16)
        if checksums is not None:
            h.update(repr(list(map(checksums.get, keys[start:end]))).encode())
        digests.append(h.digest())
        start = end
    return cuts, digests


_fqn_of = attrgetter("index.fqn")
_offset_of = attrgetter("index.offset")


def _in_place(t: torch.Tensor) -> bool:
    """Can the tensor's element bytes be checksummed where they are (no copy)?"""
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def tensor_checksum(t: torch.Tensor) -> int:
    """crc32c of a tensor's element bytes in row-major order (DEDUP-6)."""
    if _in_place(t):  # the common case (raw_view does not copy; ``t`` stays alive here)
        return int(crc32c(raw_view(t))) if t.numel() else 0
    return _copied_checksum(t)


def _copied_checksum(t: torch.Tensor, seed: int = 0) -> int:
    """``tensor_checksum`` of a tensor on another device, strided, conjugated or negated."""
    t = t.detach().resolve_conj().resolve_neg().to("cpu")
    if t.numel() == 0:
        return seed
    if not t.is_contiguous():  # a contiguous tensor is checksummed in place, without a copy
        t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return int(crc32c(t.reshape(-1).view(torch.uint8).numpy().data, seed))


def _canonical(obj: Any) -> Any:
    """An equal value whose pickle does not depend on the process (hash seed, insertion order)."""
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, sorted((_canonical(x) for x in obj), key=repr))
    if isinstance(obj, dict):
        items = ((_canonical(k), _canonical(v)) for k, v in obj.items())
        return (type(obj).__name__, sorted(items, key=repr))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_canonical(x) for x in obj])
    return obj


def object_checksum(obj: Any) -> int:
    """Checksum of a non-tensor value, equal for equal values on every rank and host (DEDUP-6)."""
    return int(crc32c(pickle.dumps(_canonical(obj), protocol=4)))


def may_be_replicated(obj: Any) -> bool:
    """False for a value no other rank can hold: a DTensor replicated along no mesh dim
    of size > 1 (its chunks are this rank's alone) (DEDUP-13)."""
    if isinstance(obj, DTensor):
        mesh = obj.device_mesh
        return any(p.is_replicate() and mesh.size(d) > 1 for d, p in enumerate(obj.placements))
    return True


#: plain CPU tensors of at least this many bytes are checksummed together (DEDUP-16)
SHARED_DIGEST_MIN_BYTES = 64 << 10


def replica_checksums(
    flat: Mapping[str, Any],
    items: Iterable[WriteItem],
    *,
    tensors: bool = True,
    objects: bool = True,
    framed: bool = False,
) -> dict[Any, int]:
    """Checksum of every item's value that other ranks may hold too, keyed like dedup
    groups items (DEDUP-6, DEDUP-13); only the tensor items' or only the objects' when
    the other kind is digested elsewhere; with ``framed``, tensors' value digests continue
    from their frame's head CRC, as the writer computes them on the way (DEDUP-17)."""
    out: dict[Any, int] = {}
    tensor_items: list[WriteItem] = []
    for item in items:
        obj = flat[item.index.fqn]
        if not may_be_replicated(obj):
            continue
        if item.type == WriteItemType.BYTE_IO:
            if objects:
                out[item_key(item)] = object_checksum(obj)
        elif tensors:
            out[item_key(item)] = 0  # its place in the order; the value below
            tensor_items.append(item)
    keys, values, seeds = replica_tensors(flat, tensor_items, framed, screened=True)
    if values:
        out.update(zip(keys, tensor_digests(values, seeds)))
    return out


def replica_tensors(
    flat: Mapping[str, Any],
    items: Iterable[WriteItem],
    framed: bool = False,
    screened: bool = False,
) -> tuple[list[Any], list[torch.Tensor], list[int]]:
    """The keys, chunks and digest seeds of the tensor items other ranks may hold too
    (DEDUP-13); with ``framed`` the seeds are the value digests' (DEDUP-17), else 0.
    ``screened``: the caller passes only such tensor items (not checked again)."""
    keys: list[Any] = []
    values: list[torch.Tensor] = []
    for item in items:
        if screened or item.type != WriteItemType.BYTE_IO:
            obj = flat[item.index.fqn]
            if screened or may_be_replicated(obj):
                keys.append(item_key(item))
                values.append(resolve_tensor_chunk(obj, item.index))
    seeds = list(map(value_digest_seed, values)) if framed else [0] * len(values)
    return keys, values, seeds


#: small in-place tensors are checksummed in batches of at most this many (or 4 MiB)
SMALL_BATCH = 512


def digest_units(
    tensors: list[torch.Tensor], seeds: list[int]
) -> tuple[list[Callable[[], None]], Callable[[], list[int]], int]:
    """Units of work computing ``tensor_checksum`` of each tensor continued from its seed,
    the function returning the digests once every unit has run, and how many bytes the
    units of plain tensors of at least 64 KiB hold (DEDUP-16, DEDUP-17).

    A unit is a tensor to copy first, a batch of small in-place tensors, or a piece of
    at most 4 MiB of a larger one (the pieces combined exactly, INTEG-11); the views do
    not keep their tensors alive: ``tensors`` does.
    """
    out = list(seeds)
    units: list[Callable[[], None]] = []
    views: list[memoryview] = []
    large: list[int] = []
    batch: list[int] = []
    batch_bytes = 0

    def copied(i: int) -> Callable[[], None]:
        def run() -> None:
            out[i] = _copied_checksum(tensors[i], seeds[i])

        return run

    def small(idx: list[int]) -> Callable[[], None]:
        def run() -> None:
            for i in idx:
                t = tensors[i]
                out[i] = crc32c_small(raw_view(t), seeds[i]) if t.nbytes else seeds[i]

        return run

    for i, t in enumerate(tensors):
        if not _in_place(t):
            units.append(copied(i))
        elif t.nbytes < SHARED_DIGEST_MIN_BYTES:  # the kernel with the cheapest call
            batch.append(i)
            batch_bytes += t.nbytes
            if len(batch) >= SMALL_BATCH or batch_bytes >= HELPER_PIECE_BYTES:
                units.append(small(batch))
                batch, batch_bytes = [], 0
        else:
            large.append(i)
            views.append(raw_view(t))
    if batch:
        units.append(small(batch))
    pieces, combine = crc32c_pieces(views, [seeds[i] for i in large])
    units.extend(pieces)

    def result() -> list[int]:
        for i, value in zip(large, combine()):
            out[i] = value
        return out

    return units, result, sum(map(len, views))


def tensor_digests(tensors: list[torch.Tensor], seeds: list[int] | None = None) -> list[int]:
    """``tensor_checksum`` of each tensor (continued from ``seeds[i]``, default 0), shared
    with a helper thread when a CPU is free and the plain tensors of at least 64 KiB hold
    16 MiB or more (DEDUP-16)."""
    units, result, shared = digest_units(tensors, seeds or [0] * len(tensors))
    work = TwoEnds(units)
    helpers = helpers_if_cpu_free() if shared >= EACH_SHARE_MIN_BYTES else None
    if helpers is not None:
        helpers.submit(work.help)
    work.finish()
    return result()


def resolve_tensor_chunk(obj: Any, index: MetadataIndex) -> torch.Tensor:
    """The local tensor holding the chunk ``index`` of ``obj`` (PLAN-1)."""
    getter = getattr(obj, "__get_tensor_shard__", None)
    if getter is not None:
        t: torch.Tensor = getter(index)
        return t
    if isinstance(obj, ShardedTensor):
        for shard in obj.local_shards():
            if torch.Size(shard.metadata.shard_offsets) == index.offset:
                return shard.tensor
        raise ValueError(f"{index.fqn!r} has no local shard at {index.offset}")
    if isinstance(obj, torch.Tensor):
        return obj
    raise ValueError(f"{index.fqn!r} is not a tensor")
