"""The save planner, written to be read: torch's ``SavePlanner`` in five short steps.

1. ``set_up_planner``: flatten the state dict to FQNs (FLAT-1..6).
2. ``create_local_plan`` (every rank): refuse every value a default load could never read
   back (SAVE-12), then one write item per chunk this rank holds
   (PLAN-1, PLAN-2), each item's value checksum (DEDUP-13) and the structure
   record (FLAT-6) in ``planner_data``.
3. ``create_global_plan`` (coordinator): the dedup rule (:mod:`.dedup`), then the
   global metadata and its checks (:mod:`.metadata`); any problem fails the
   save before anything is written (META-5, DEDUP-4, DEDUP-6).
4. ``finish_plan``: the coordinator's plan is final as sent.
5. ``resolve_data``: the chunk tensor, or ``torch.save`` bytes of an object (PLAN-6).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import crc32c
import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from refdcp.planning.errors import (
    PlanValidationError,
    ReplicaMismatchError,
    UnloadableValueError,
)

from .dedup import item_key, reference_dedup
from .flatten import RESERVED_KEY, flatten, structure
from .format import plain_values
from .metadata import build_metadata
from .policy import unpickle_value

__all__ = ["ReferenceSavePlanner", "chunk_of", "unloadable", "value_checksum", "write_items"]


class ReferenceSavePlanner(SavePlanner):
    """Plan a save: local items, dedup, metadata (PLAN-1, DEDUP-1..7, META-1..5)."""

    def __init__(
        self,
        *,
        check_replicas: bool = True,
        bytes_on_coordinator: bool = True,
        dedup_save_to_lowest_rank: bool = False,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        self.check_replicas = check_replicas
        self.safe_globals = list(safe_globals)
        self.bytes_on_coordinator = bytes_on_coordinator
        self.lowest_rank = dedup_save_to_lowest_rank
        self.values: dict[str, Any] = {}
        self.is_coordinator = False

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten the state dict (FLAT-1..5); keep what the plan records (FLAT-6)."""
        self.flat = flatten(state_dict)
        self.values = self.flat.items
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """This rank's items, their checksums and its structure record (PLAN-1, DEDUP-13, FLAT-6)."""
        problems = unloadable(self.values, self.safe_globals)
        if problems:
            raise UnloadableValueError(problems)
        items = [i for fqn, value in self.values.items() for i in write_items(fqn, value)]
        planned = {i.index.fqn for i in items}
        record: dict[str, Any] = structure(self.flat)
        record["without_chunks"] = {  # sharded tensors this rank holds no chunk of (PLAN-1, META-1)
            fqn: (TensorProperties(dtype=v.dtype), torch.Size(v.size()))
            for fqn, v in self.values.items()
            if fqn not in planned and _is_tensor(v) and _holds_rank(v)
        }
        record["checksums"] = (
            {item_key(i): value_checksum(self._value_of(i)) for i in items}
            if self.check_replicas
            else None
        )
        planner_data: dict[str, Any] = {**self.flat.paths, RESERVED_KEY: record}
        return SavePlan(items, planner_data=planner_data)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Dedup, then the metadata; every problem at once (DEDUP-1..7, META-1..5)."""
        records = [p.planner_data[RESERVED_KEY] for p in all_plans]
        kept, problems, _ = reference_dedup(
            [p.items for p in all_plans],
            checksums=[r["checksums"] for r in records],
            bytes_on_coordinator=self.bytes_on_coordinator,
            lowest_rank=self.lowest_rank,
        )
        without_chunks: dict[str, Any] = {}
        for r in reversed(records):
            without_chunks.update(r["without_chunks"])
        md, meta_problems = build_metadata(kept, without_chunks)
        if RESERVED_KEY in md:
            problems.append(f"the FQN {RESERVED_KEY!r} is reserved by refdcp's planner")
        if problems or meta_problems:
            every = problems + meta_problems
            tensors = {
                i.index.fqn for p in all_plans for i in p.items if i.type != WriteItemType.BYTE_IO
            }
            # only tensor values that differ: the error refdcp raises after its writes (DEDUP-17)
            replicas = all(
                " differ in value between ranks" in p
                and any(p.startswith(f"replicas of {fqn!r}") for fqn in tensors)
                for p in every
            )
            raise (ReplicaMismatchError if replicas else PlanValidationError)(every)
        metadata = Metadata(state_dict_metadata=md, planner_data=_merged(all_plans))
        plans = [SavePlan(items, storage_data=p.storage_data) for p, items in zip(all_plans, kept)]
        return plans, metadata

    def _value_of(self, item: WriteItem) -> Any:
        """The value an item's checksum is computed over: its chunk, or the object."""
        if item.type == WriteItemType.BYTE_IO:
            return self.values[item.index.fqn]
        return self.resolve_data(item)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The chunk's tensor, or ``torch.save`` bytes of a non-tensor value (PLAN-6)."""
        value = self.values[write_item.index.fqn]
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(value, buf)
            buf.seek(0)
            return buf
        return chunk_of(value, write_item.index).detach()


def _merged(all_plans: list[SavePlan]) -> dict[str, Any]:
    """torch's FQN -> path map of every rank, the lowest rank winning, and refdcp's
    structure record: every rank's rich paths and empty containers (FLAT-2..4, FLAT-6)."""
    merged: dict[str, Any] = {}
    rich: dict[str, Any] = {}
    empties: list[Any] = []
    for plan in reversed(all_plans):
        record = plan.planner_data[RESERVED_KEY]
        merged.update({k: v for k, v in plan.planner_data.items() if k != RESERVED_KEY})
        rich.update(record["rich"])
        empties += [e for e in record["empties"] if e not in empties]
    merged[RESERVED_KEY] = {"version": 1, "rich": rich, "empties": empties}
    return merged


def unloadable(values: dict[str, Any], safe_globals: Sequence[Any] = ()) -> list[str]:
    """One line per value a save must refuse, naming its key, type and cause (SAVE-12): a tensor
    with no values (meta) or not dense (sparse), or an object that cannot be pickled or whose
    pickle a default load (weights_only, the allow-list plus ``safe_globals``) cannot read."""
    problems = []
    for fqn, value in values.items():
        why = _why_unloadable(value, safe_globals)
        if why is not None:
            problems.append(f"key {fqn!r}, type {type(value).__qualname__}: {why}")
    return problems


def _why_unloadable(value: Any, safe_globals: Sequence[Any]) -> str | None:
    if isinstance(value, (DTensor, ShardedTensor, torch.Tensor)):
        local = (
            [s.tensor for s in value.local_shards()]
            if isinstance(value, ShardedTensor)
            else [value.to_local() if isinstance(value, DTensor) else value]
        )
        for t in local:
            if t.is_meta:
                return "a meta tensor has no values; materialise it before saving"
            if t.layout != torch.strided:
                return f"a {t.layout} tensor is not dense; save t.to_dense()"
        return None
    if hasattr(value, "__create_write_items__"):
        return None  # saved through its own write items (PLAN-3), never pickled
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as exc:
        return f"cannot be pickled ({type(exc).__name__}: {exc}); convert it to plain data"
    buf.seek(0)
    try:
        unpickle_value("", buf, safe_globals)
    except Exception as exc:
        return (
            f"a default load (weights_only=True) cannot read it back ({type(exc).__name__}); "
            "allow its type with safe_globals=[...] at save and at load, or convert it"
        )
    return None


def write_items(fqn: str, value: Any) -> list[WriteItem]:
    """One item per non-empty chunk this rank holds (PLAN-1); a Partial DTensor is refused,
    a DTensor whose mesh lacks this rank has none (PLAN-2)."""
    if isinstance(value, DTensor):
        if any(p.is_partial() for p in value.placements):
            raise ValueError(
                f"{fqn!r} is a DTensor with a Partial placement {value.placements}; "
                "reduce it (e.g. redistribute to Replicate) before checkpointing"
            )
        if value.device_mesh.get_coordinate() is None:
            return []
    if hasattr(value, "__create_write_items__"):  # DTensor, LocalShards (PLAN-3)
        items: list[WriteItem] = value.__create_write_items__(fqn, value)
        return [i for i in items if not _empty_shard(i)]
    if isinstance(value, ShardedTensor):
        return [
            _tensor_item(fqn, s.tensor, s.metadata.shard_offsets, value.size(), WriteItemType.SHARD)
            for s in value.local_shards()
            if s.tensor.numel() > 0
        ]
    if isinstance(value, torch.Tensor):
        return [_tensor_item(fqn, value, [0] * value.dim(), value.size(), WriteItemType.TENSOR)]
    return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]


def _tensor_item(
    fqn: str, t: torch.Tensor, offsets: Any, size: torch.Size, kind: WriteItemType
) -> WriteItem:
    offsets = torch.Size(offsets)
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=t.size())
    data = TensorWriteData(chunk, TensorProperties.create_from_tensor(t), torch.Size(size))
    return WriteItem(index=MetadataIndex(fqn, offsets), type=kind, tensor_data=data)


def _empty_shard(item: WriteItem) -> bool:
    td = item.tensor_data
    return item.type == WriteItemType.SHARD and td is not None and 0 in td.chunk.sizes


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor))


def _holds_rank(value: Any) -> bool:
    """False for a DTensor whose mesh does not contain this rank (PLAN-2)."""
    return not (isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None)


def chunk_of(value: Any, index: MetadataIndex) -> torch.Tensor:
    """The local tensor that holds the chunk ``index`` of ``value`` (PLAN-1, PLAN-6)."""
    if hasattr(value, "__get_tensor_shard__"):
        shard: torch.Tensor = value.__get_tensor_shard__(index)
        return shard
    if isinstance(value, ShardedTensor):
        for s in value.local_shards():
            if torch.Size(s.metadata.shard_offsets) == index.offset:
                return s.tensor
        raise ValueError(f"{index.fqn!r} has no local shard at {index.offset}")
    if isinstance(value, torch.Tensor):
        return value
    raise ValueError(f"{index.fqn!r} is not a tensor")


def value_checksum(value: Any) -> int:
    """A checksum equal for equal values on every rank (DEDUP-6): the CRC-32C of a dense
    tensor's bytes, else of the object's pickle with sets and dicts sorted."""
    if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized:
        raw = plain_values(value).reshape(-1).view(torch.uint8)
        return int(crc32c.crc32c(raw.numpy().tobytes()))
    return int(crc32c.crc32c(pickle.dumps(_canonical(value), protocol=4)))


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
