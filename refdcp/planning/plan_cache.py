"""Plan caching across saves of the same structure (PLAN-9..12; torch's ``enable_plan_caching``).

Local side: a rank whose flattened state dict has the structure of its last
successful save (same FQNs, kinds, shapes, dtypes, tensor properties, chunks,
key types, empty containers) sends a marker instead of its plan, and reuses
its final plan. Coordinator side: when every rank sent a marker, the cached
global plans and metadata are reused; replica digests (DEDUP-13) are still
compared on every save. Any changed rank sends its full plan and the global
plan is rebuilt from the cached plans of the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from refdcp.planning.errors import PlanCacheError

from .flatten import Flattened, encode_structure, is_tensor_like
from .local_plan import ItemKey, _signature, item_key, object_write_items

__all__ = ["GlobalPlanCache", "LocalPlanCache", "PlanCacheError", "structure_fingerprint"]


def _tensor_structure(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.dtype, t.layout, t.requires_grad, t.device.type, t.is_pinned())


def structure_fingerprint(flat: Flattened) -> tuple[Any, ...]:
    """Everything a local save plan and its planner data depend on, values excluded (PLAN-9).

    Plain tensors contribute their shape and properties; sharded values (DTensor,
    ShardedTensor, LocalShards, ...) their write items' signatures (chunks); other
    objects only their FQN. Key types and empty containers are included through
    refdcp's structure record (FLAT-3, FLAT-2).
    """
    parts: list[Any] = []
    for fqn, obj in flat.items.items():
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            parts.append((fqn, _tensor_structure(obj)))
        elif is_tensor_like(obj) or hasattr(obj, "__create_write_items__"):
            items = object_write_items(fqn, obj)
            size = obj.size() if callable(getattr(obj, "size", None)) else None
            parts.append(
                (fqn, type(obj), tuple(map(_signature, items)), _props(items), _dtype(obj), size)
            )
        else:
            parts.append((fqn,))
    return (tuple(parts), repr(encode_structure(flat)))


def _dtype(obj: Any) -> Any:
    return getattr(obj, "dtype", None)


def _props(items: Sequence[WriteItem]) -> tuple[Any, ...]:
    out = []
    for i in items:
        p = i.tensor_data.properties if i.tensor_data else None
        out.append(
            None
            if p is None
            else (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        )
    return tuple(out)


@dataclass
class LocalPlanCache:
    """One rank's last successful plan: its structure, local plan and final plan (PLAN-9)."""

    fingerprint: tuple[Any, ...] | None = None
    fingerprint_id: int = 0
    local_items: list[WriteItem] = field(default_factory=list)
    final_plan: SavePlan | None = None
    #: the digest (PLAN-15) of ``local_items``' plan: it names their keys (DEDUP-17)
    plan_digest: str | None = None
    #: set by create_local_plan, promoted by finish_plan once the global plan succeeded
    pending: tuple[tuple[Any, ...], int, list[WriteItem], str | None] | None = None

    def hit(self, fingerprint: tuple[Any, ...]) -> bool:
        return self.final_plan is not None and self.fingerprint == fingerprint


@dataclass
class GlobalPlanCache:
    """The coordinator's last successful global plan and what checking replicas needs (PLAN-10)."""

    all_plans: list[SavePlan]
    fingerprint_ids: list[int | None]
    global_plans: list[SavePlan]
    metadata: Metadata
    #: for each rank, the rank whose digests it must equal (same items), itself for class reps
    ref: list[int]
    #: keys held by ranks of different classes, grouped by the class reps holding them
    cross: dict[tuple[int, ...], list[ItemKey]]
    #: the coordinator's items other ranks hold: the ones it digests (DEDUP-13)
    coordinator_shared: list[WriteItem] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        all_plans: list[SavePlan],
        extras: Sequence[Mapping[str, Any]],
        global_plans: list[SavePlan],
        metadata: Metadata,
    ) -> GlobalPlanCache:
        ref: list[int] = []
        rep_of: dict[Any, int] = {}
        for r, e in enumerate(extras):
            d = e.get("digest")
            ref.append(rep_of.setdefault(d, r) if d is not None else r)
        reps = sorted(set(ref))
        counts: Counter[ItemKey] = Counter()
        for r in reps:
            counts.update(map(item_key, all_plans[r].items))
        holders: dict[ItemKey, list[int]] = {}
        if len(reps) > 1:
            for r in reps:
                for k in map(item_key, all_plans[r].items):
                    if counts[k] > 1:
                        holders.setdefault(k, []).append(r)
        cross: dict[tuple[int, ...], list[ItemKey]] = {}
        for k, rs in holders.items():
            cross.setdefault(tuple(rs), []).append(k)
        return cls(
            all_plans=all_plans,
            fingerprint_ids=[e.get("fingerprint") for e in extras],
            global_plans=global_plans,
            metadata=metadata,
            ref=ref,
            cross=cross,
        )

    def replicas_agree(self, sums: Sequence[Mapping[Any, int] | None]) -> bool:
        """True when every rank's digests equal its class rep's and cross-class keys agree
        (DEDUP-13); False (also for a digest present on one holder only) sends the save
        down the full path, which reports any disagreement."""
        for r, ref in enumerate(self.ref):
            if ref != r and sums[r] != sums[ref]:
                return False
        for reps, keys in self.cross.items():
            first = None
            for r in reps:
                s = sums[r]
                vals = list(map(s.get, keys)) if s is not None else [None] * len(keys)
                if first is None:
                    first = vals
                elif vals != first:
                    return False
        return True
