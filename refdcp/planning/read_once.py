"""Read-once loads: each stored item several ranks need is read by one of them (spec/read_once.md).

The coordinator's global plan gives every stored item (one saved chunk, or one
non-tensor value) that two or more ranks' local plans read to exactly one of
those ranks (:func:`assign_readers`, the rule of
``refdcp/reference/load_planner.py``'s ``read_once_readers``, ONCE-1). That
rank reads every box of the item any rank needs, checked as its own reads are
(ONCE-4), and puts them in its read outcome; the load protocol's all-gather of
read outcomes carries them to every rank (ONCE-3), and each rank copies its
boxes into its destinations at the start of its apply step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from refdcp.errors import RefdcpError
from refdcp.storage.format.tensor_values import bytes_are_values

__all__ = [
    "ReadOnceOffer",
    "ReadOnceRole",
    "ReadOnceState",
    "Sent",
    "assign_readers",
    "box_key",
    "split_plans",
    "stored_key",
]

#: A stored item: its FQN and its saved chunk's offsets (``()`` for a non-tensor value).
StoredKey = tuple[str, tuple[int, ...]]
#: One box of a stored item: the stored item, the box's offsets in it and its lengths.
BoxKey = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class ReadOnceOffer:
    """A local plan's ``planner_data``: this rank takes part in a read-once load (ONCE-6)."""


@dataclass(frozen=True)
class ReadOnceRole:
    """A final plan's ``planner_data``: what this rank sends and receives (ONCE-2, ONCE-3).

    ``sends``: the boxes this rank reads and puts in its read outcome;
    ``fetch``: the reads among the plan's items made only for other ranks;
    ``receives``: this rank's own reads that arrive from another rank, with that rank.
    """

    sends: tuple[BoxKey, ...]
    fetch: tuple[ReadItem, ...]
    receives: tuple[tuple[ReadItem, int], ...]


@dataclass(frozen=True)
class Sent:
    """One rank's read outcome in a read-once load: the boxes it read for others, each
    checked before it was put here, and the ``verify`` mode that checked them (ONCE-4)."""

    verify: bool | None
    pieces: dict[BoxKey, Any]


def stored_key(item: ReadItem) -> StoredKey:
    """The stored item a read reads from (ONCE-1)."""
    offset = item.storage_index.offset
    return (item.storage_index.fqn, () if offset is None else tuple(offset))


def box_key(item: ReadItem) -> BoxKey:
    """The box of its stored item that a read reads (ONCE-2)."""
    fqn, offset = stored_key(item)
    return (fqn, offset, tuple(item.storage_offsets), tuple(item.lengths))


def assign_readers(plans: list[LoadPlan], metadata: Metadata) -> dict[StoredKey, int]:
    """The reader of every stored item two or more ranks read (ONCE-1): largest first, to
    the least loaded rank among those reading it (ties to the lowest rank), after each
    rank's load starts at the bytes of the items it alone reads.

    Equal to the reference ``read_once_readers`` on any input (ONCE-8); faster by
    finding each chunk's size once per FQN instead of once per item.
    """
    holders: dict[StoredKey, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            ranks = holders.setdefault(stored_key(item), [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    sizes = _sizes(metadata, holders)
    load = [0] * len(plans)
    shared: list[tuple[int, StoredKey]] = []
    for key, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += sizes[key]
        else:
            shared.append((-sizes[key], key))
    shared.sort()
    readers: dict[StoredKey, int] = {}
    for neg, key in shared:
        reader = min(holders[key], key=lambda r: (load[r], r))
        load[reader] -= neg
        readers[key] = reader
    return readers


def _sizes(metadata: Metadata, keys: Any) -> dict[StoredKey, int]:
    per_fqn: dict[str, dict[tuple[int, ...], int]] = {}
    out: dict[StoredKey, int] = {}
    for key in keys:
        fqn = key[0]
        table = per_fqn.get(fqn)
        if table is None:
            table = per_fqn[fqn] = {}
            md = metadata.state_dict_metadata.get(fqn)
            if isinstance(md, TensorStorageMetadata):
                itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
                for chunk in md.chunks:
                    table[tuple(chunk.offsets)] = chunk.sizes.numel() * itemsize
            else:
                table[()] = 1
        out[key] = table.get(key[1], 0)
    return out


def split_plans(plans: list[LoadPlan], readers: dict[StoredKey, int]) -> list[LoadPlan]:
    """Each rank's final plan (ONCE-2): its reads of items it reads (alone or as their
    reader), the reads it makes for others, and in ``planner_data`` its :class:`ReadOnceRole`."""
    boxes: dict[BoxKey, tuple[ReadItem, set[int]]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if stored_key(item) in readers:
                entry = boxes.setdefault(box_key(item), (item, set()))
                entry[1].add(rank)
    out = []
    for rank, plan in enumerate(plans):
        keep: list[ReadItem] = []
        receives: list[tuple[ReadItem, int]] = []
        own: set[BoxKey] = set()
        for item in plan.items:
            reader = readers.get(stored_key(item), rank)
            if reader == rank:
                keep.append(item)
                own.add(box_key(item))
            else:
                receives.append((item, reader))
        sends: list[BoxKey] = []
        fetch: list[ReadItem] = []
        for box, (item, ranks) in boxes.items():
            if readers[stored_key(item)] != rank or ranks == {rank}:
                continue
            sends.append(box)
            if box not in own:
                fetch.append(_fetch_item(item))
        out.append(
            LoadPlan(
                keep + fetch,
                storage_data=plan.storage_data,
                planner_data=ReadOnceRole(tuple(sends), tuple(fetch), tuple(receives)),
            )
        )
    return out


#: The destination FQN of a read made for other ranks starts with this (no rank's own read
#: has it, so the two never compare equal even when they read the same box).
FETCH_PREFIX = "\x00read_once:"


def _fetch_item(item: ReadItem) -> ReadItem:
    """A read of ``item``'s box into a scratch tensor: its destination names the stored chunk."""
    zeros = torch.Size([0] * len(item.lengths))
    fqn = FETCH_PREFIX + item.storage_index.fqn
    return ReadItem(
        type=item.type,
        dest_index=MetadataIndex(fqn, item.storage_index.offset, None),
        dest_offsets=zeros,
        storage_index=item.storage_index,
        storage_offsets=item.storage_offsets,
        lengths=item.lengths,
    )


class ReadOnceState:
    """One rank's part in a read-once load, kept by its planner between ``finish_plan``
    and the apply step (ONCE-2..5)."""

    def __init__(self, role: ReadOnceRole) -> None:
        self.role = role
        self.fetch = set(role.fetch)
        self.scratch: dict[BoxKey, torch.Tensor] = {}
        self.blobs: dict[BoxKey, bytes] = {}
        self.sending = set(role.sends)
        self.own: dict[BoxKey, ReadItem] = {}

    def add_fetch(self, item: ReadItem) -> ReadItem:
        """A read of ``item``'s box into scratch, for a box the destination cannot send."""
        fetch = _fetch_item(item)
        self.fetch.add(fetch)
        return fetch

    def scratch_for(self, item: ReadItem, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(item.lengths, dtype=dtype)
        self.scratch[box_key(item)] = t
        return t

    def keep_blob(self, item: ReadItem, value: io.BytesIO) -> None:
        key = box_key(item)
        if key in self.sending:
            self.blobs[key] = value.getvalue()


def piece(t: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray[Any, Any]]:
    """A box's values as plain data: dtype name, shape, row-major bytes (ONCE-3), the bytes
    a numpy array over the tensor's memory when it holds them (pickled out of band by
    ``TorchDistComm``, COMM-63), else over a copy."""
    t = t.detach()
    if t.device.type != "cpu" or not bytes_are_values(t):
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


def unpiece(p: tuple[str, tuple[int, ...], np.ndarray[Any, Any]]) -> torch.Tensor:
    name, shape, raw = p
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RefdcpError(f"read-once piece names no dtype: {name!r}")
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    if not raw.flags.writeable:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def check_sender(sent: Any, source: int, verify: bool | None) -> Sent:
    """What rank ``source`` sent, checked under this load's ``verify`` mode (ONCE-4)."""
    if not isinstance(sent, Sent):
        raise RefdcpError(
            f"read-once load: rank {source} sent no pieces (its planner did not take part)"
        )
    if sent.verify != verify:
        raise RefdcpError(
            f"read-once load: rank {source} checked its pieces with verify={sent.verify}, "
            f"this rank loads with verify={verify}; every rank must pass the same verify="
        )
    return sent


def is_bytes(item: ReadItem) -> bool:
    return item.type == LoadItemType.BYTE_IO
