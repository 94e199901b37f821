"""The load planner, written to be read: torch's ``LoadPlanner`` in four short steps.

1. ``set_up_planner``: flatten the destination state dict (FLAT-1).
2. ``create_local_plan``: check it against the checkpoint, every problem at once,
   before any read (POLICY-1..6); then, for every chunk this rank wants, one read
   per saved chunk it overlaps (RESHARD-1..3), and a check that the reads tile the
   chunk exactly (RESHARD-5).
3. ``load_bytes``: unpickle an object weights-only and put it back where it was
   nested (PLAN-7, LOAD-7, LOAD-8, FLAT-2..4).
4. ``resolve_tensor``: the part of the destination a read fills (STORE-12).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from refdcp.planning.errors import LoadPolicyError
from refdcp.storage import MalformedMetadataError

from .flatten import flatten, set_by_rich_path
from .format import METADATA
from .metadata import chunk_problems
from .policy import check_load, unpickle_value
from .save_planner import chunk_of

__all__ = ["ReferenceLoadPlanner", "read_once_readers", "reads_for_chunk", "wanted_chunks"]


class ReferenceLoadPlanner(LoadPlanner):
    """Check, then plan resharded reads (POLICY-1, RESHARD-1)."""

    def __init__(
        self,
        *,
        strict: bool = True,
        reject_unexpected: bool = False,
        allow_cast: bool = False,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        self.strict, self.reject_unexpected, self.allow_cast = strict, reject_unexpected, allow_cast
        self.safe_globals = list(safe_globals)
        #: set by refdcp's load driver: nested objects wait for the apply step (LOAD-19)
        self.defer_nested_values = False
        self.nested: list[tuple[Any, Any]] = []

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None:
            raise ValueError("ReferenceLoadPlanner needs the checkpoint's metadata")
        self.state_dict = state_dict
        self.flat = flatten(state_dict)
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        """Every problem at once, before any read (POLICY-1); then the reads (RESHARD-1, -5)."""
        saved = self.metadata.state_dict_metadata
        keys, problems = check_load(
            self.flat.items,
            saved,
            strict=self.strict,
            reject_unexpected=self.reject_unexpected,
            allow_cast=self.allow_cast,
        )
        if problems:
            raise LoadPolicyError(problems)
        reads: list[ReadItem] = []
        for fqn in keys:
            md = saved[fqn]
            if isinstance(md, TensorStorageMetadata):
                check_tiling(fqn, md)
            if not isinstance(md, TensorStorageMetadata):
                index = MetadataIndex(fqn)
                zero = torch.Size((0,))
                reads.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
                continue
            for i, target in enumerate(wanted_chunks(self.flat.items[fqn])):
                chunk_reads = reads_for_chunk(fqn, i, target, md.chunks)
                problems += _coverage_problem(fqn, target, chunk_reads)
                reads += chunk_reads
        if problems:
            raise LoadPolicyError(problems)
        return LoadPlan(reads)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle weights-only with the allow-list, into its original nesting (PLAN-7, LOAD-9)."""
        fqn = read_item.dest_index.fqn
        obj = unpickle_value(fqn, value, self.safe_globals)
        path = self.flat.rich[fqn]
        if len(path) > 1 and self.defer_nested_values:
            self.nested.append((path, obj))  # placed once every rank has read (LOAD-19)
        else:
            set_by_rich_path(self.state_dict, path, obj)
        self.flat.items[fqn] = obj

    def apply_loaded_values(self) -> None:
        """Place the nested objects this load read, now that every rank read all (LOAD-19)."""
        for path, obj in self.nested:
            set_by_rich_path(self.state_dict, path, obj)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination chunk, narrowed to the read's box (RESHARD-2, STORE-12)."""
        value = self.flat.items[read_item.dest_index.fqn]
        if isinstance(value, DTensor):
            t = value.to_local()
        else:
            t = chunk_of(
                value, MetadataIndex(read_item.dest_index.fqn, read_item.dest_index.offset)
            )
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out the destination itself: nothing to copy back


def check_tiling(fqn: str, md: TensorStorageMetadata) -> None:
    """The stored chunks of a key to be read tile its tensor exactly: inside it, no overlap, no
    hole (FMT-28) -- META-2/3's rule, applied to what the checkpoint says before any read."""
    problems = chunk_problems(
        tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    )
    if problems:
        chunks = [(list(c.offsets), list(c.sizes)) for c in md.chunks]
        raise MalformedMetadataError(
            f"stored chunks do not tile the tensor ({', '.join(sorted(set(problems)))}): {chunks}",
            field=f"state_dict_metadata[{fqn!r}].chunks",
            file=METADATA,
        )


def wanted_chunks(value: Any) -> list[ChunkStorageMetadata]:
    """The chunks of a tensor value this rank holds (PLAN-1); none for a DTensor whose
    mesh lacks this rank (PLAN-2)."""
    if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
        return []
    if hasattr(value, "__create_chunk_list__"):
        chunks: list[ChunkStorageMetadata] = value.__create_chunk_list__()
        return chunks
    if isinstance(value, ShardedTensor):
        return [
            ChunkStorageMetadata(
                torch.Size(s.metadata.shard_offsets), torch.Size(s.metadata.shard_sizes)
            )
            for s in value.local_shards()
        ]
    return [ChunkStorageMetadata(torch.Size([0] * value.dim()), value.size())]


def reads_for_chunk(
    fqn: str, index: int, target: ChunkStorageMetadata, saved: Sequence[ChunkStorageMetadata]
) -> list[ReadItem]:
    """One read per saved chunk that overlaps ``target``: the intersection's box, relative to
    the target (``dest_offsets``) and to the saved chunk (``storage_offsets``) (RESHARD-1..3)."""
    reads = []
    for chunk in saved:
        lo = [max(t, s) for t, s in zip(target.offsets, chunk.offsets)]
        hi = [
            min(t + n, s + m)
            for t, n, s, m in zip(target.offsets, target.sizes, chunk.offsets, chunk.sizes)
        ]
        if math.prod(target.sizes) == 0 or math.prod(chunk.sizes) == 0:
            continue  # an empty chunk has nothing to read (RESHARD-3)
        if any(h <= low for low, h in zip(lo, hi)):
            continue  # no common element
        reads.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, target.offsets, index),
                dest_offsets=torch.Size(low - t for low, t in zip(lo, target.offsets)),
                storage_index=MetadataIndex(fqn, chunk.offsets),
                storage_offsets=torch.Size(low - s for low, s in zip(lo, chunk.offsets)),
                lengths=torch.Size(h - low for low, h in zip(lo, hi)),
            )
        )
    return reads


def _coverage_problem(fqn: str, target: ChunkStorageMetadata, reads: list[ReadItem]) -> list[str]:
    """The reads must cover the target exactly once: a hole or an overlap is refused (RESHARD-5)."""
    got, want = sum(math.prod(r.lengths) for r in reads), math.prod(target.sizes)
    if got == want:
        return []
    how = "leave elements unread" if got < want else "overlap"
    return [
        f"{fqn!r}: the checkpoint's chunks {how} in the target chunk at {list(target.offsets)} "
        f"sizes {list(target.sizes)} ({got} of {want} elements read)"
    ]


def read_once_readers(plans: list[LoadPlan], metadata: Metadata) -> dict[tuple[Any, ...], int]:
    """Which rank reads each stored item that several ranks read, in a read-once load (ONCE-1).

    A stored item is one saved chunk (its FQN and offsets) or one non-tensor
    value (its FQN and ``()``). Each rank's load starts at the bytes of the
    items only it reads; then the shared items, largest first (ties by key),
    each go to the least loaded rank among those that read it (ties to the
    lowest rank), whose load grows by the item's bytes (a chunk's bytes, 1 for
    a non-tensor value, as DEDUP-3 counts). The planner's ``assign_readers``
    gives the same answer (ONCE-8).
    """
    holders: dict[tuple[Any, ...], list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            offset = item.storage_index.offset
            key = (item.storage_index.fqn, () if offset is None else tuple(offset))
            ranks = holders.setdefault(key, [])
            if rank not in ranks:
                ranks.append(rank)
    load = [0] * len(plans)
    for key, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += _stored_bytes(metadata, key)
    shared = [key for key, ranks in holders.items() if len(ranks) > 1]
    readers = {}
    for key in sorted(shared, key=lambda k: (-_stored_bytes(metadata, k), k)):
        reader = min(holders[key], key=lambda r: (load[r], r))
        load[reader] += _stored_bytes(metadata, key)
        readers[key] = reader
    return readers


def _stored_bytes(metadata: Metadata, key: tuple[Any, ...]) -> int:
    md = metadata.state_dict_metadata[key[0]]
    if not isinstance(md, TensorStorageMetadata):
        return 1
    for chunk in md.chunks:
        if tuple(chunk.offsets) == key[1]:
            return math.prod(chunk.sizes) * md.properties.dtype.itemsize
    return 0
