"""What both dedup paths share: the result, the replica screens and DEDUP-2's greedy.

``classes.py`` (whole plans, one class of identical plans at a time) and
``blocks.py`` (blocks of plans that differ, DEDUP-14) both import these, so the
two apply one rule and neither imports the other.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, ne
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from refdcp.planning.dedup.deferred import key_place
from refdcp.planning.local_plan import ItemKey, _signature, chunk_nbytes

__all__ = ["DedupResult", "assign_largest_first"]

_td = attrgetter("tensor_data")


@dataclass
class DedupResult:
    """Per-rank kept items, per-rank bytes, and every problem found (DEDUP-4..6)."""

    plans: list[list[WriteItem]]
    problems: list[str] = field(default_factory=list)
    #: the lowest rank of each group of ranks with identical local plans
    class_reps: list[int] = field(default_factory=list)

    def rank_bytes(self) -> list[int]:
        """Bytes each rank writes (chunk bytes; 1 per object) (DEDUP-3)."""
        return [sum(map(chunk_nbytes, p)) for p in self.plans]


_sig_tensor = attrgetter(
    "type", "tensor_data.chunk.sizes", "tensor_data.properties.dtype", "tensor_data.size"
)


def _fast_signature(item: WriteItem) -> tuple[Any, ...]:
    if item.tensor_data is None:
        return (item.type,)
    sig: tuple[Any, ...] = _sig_tensor(item)
    return sig


def _suspects(
    keys_of: Sequence[list[ItemKey]],
    items_of: Sequence[list[WriteItem]],
    sums_of: Sequence[Mapping[Any, int] | None],
) -> set[ItemKey]:
    """Keys whose replicas may disagree in kind, dtype, shape or checksum: a C-level screen.

    Each class's signatures (and checksums) are compared with the first class
    holding the key, through ``dict.setdefault`` and ``operator.ne`` mapped over
    whole plans, so agreeing replicas cost no Python-level work per item (DEDUP-8).
    """
    if len(keys_of) < 2:  # no key is held by two classes: nothing to compare
        return set()
    first_sig: dict[ItemKey, Any] = {}
    first_sum: dict[ItemKey, int] = {}
    out: set[ItemKey] = set()
    for keys, items, sums in zip(keys_of, items_of, sums_of):
        if all(map(_td, items)):  # all tensors: the signature is one C-level attrgetter
            sigs = list(map(_sig_tensor, items))
        else:
            sigs = list(map(_fast_signature, items))
        seen = map(first_sig.setdefault, keys, sigs)
        out.update(compress(keys, map(ne, seen, sigs)))
        if sums is not None:
            vals = list(map(sums.get, keys))
            known = [v is not None for v in vals]
            ks = list(compress(keys, known))
            vs: list[int] = [v for v in vals if v is not None]
            out.update(compress(ks, map(ne, map(first_sum.setdefault, ks, vs), vs)))
    return out


def _disagreements(
    key: ItemKey,
    cls: list[int],
    item_of: Mapping[int, dict[ItemKey, WriteItem]],
    members_of: list[list[int]],
    reps: list[int],
    sums: list[Mapping[Any, int] | None],
) -> list[str]:
    """Problems among replicas of ``key`` held by several classes (DEDUP-4, DEDUP-6)."""
    where = key_place(key)
    by_sig: dict[Any, list[int]] = {}
    for c in cls:
        by_sig.setdefault(_signature(item_of[c][key])[2:], []).extend(members_of[c])
    problems = []
    if len(by_sig) > 1:
        desc = "; ".join(f"ranks {sorted(rs)} hold {_describe(sig)}" for sig, rs in by_sig.items())
        problems.append(f"replicas of {where} disagree in type, dtype or shape: {desc}")
        return problems
    by_sum: dict[int | None, list[int]] = {}
    for c in cls:
        s = sums[reps[c]]
        by_sum.setdefault(None if s is None else s.get(key), []).extend(members_of[c])
    known = {s: rs for s, rs in by_sum.items() if s is not None}
    if len(known) > 1:
        desc = "; ".join(f"ranks {sorted(rs)} hold checksum {s:#010x}" for s, rs in known.items())
        problems.append(f"replicas of {where} differ in value between ranks: {desc}")
    return problems


def _describe(sig: tuple[Any, ...]) -> str:
    if len(sig) == 1:
        return "a non-tensor object"
    kind = {WriteItemType.TENSOR.value: "tensor", WriteItemType.SHARD.value: "shard"}.get(
        sig[0], "item"
    )
    return f"a {kind} of chunk shape {sig[1]}, dtype {sig[2]}, global shape {sig[3]}"


def assign_largest_first(
    replicated: list[tuple[int, ItemKey, list[int], WriteItem]],
    owner: dict[ItemKey, int],
    loads: list[int],
    world: int,
    coordinator_rank: int,
    bytes_on_coordinator: bool,
    lowest_rank: bool,
) -> None:
    """DEDUP-2: each replicated key, largest first, to its least loaded holder (ties: lowest rank).

    Fills ``owner`` and adds to ``loads`` in place; shared by the whole-plan and
    the block dedup (DEDUP-14), so both apply one rule.
    """
    replicated.sort(key=lambda e: -e[0])
    load_of = loads.__getitem__
    heap = [(load, r) for r, load in enumerate(loads)]  # least loaded of all ranks, lazily
    heapq.heapify(heap)
    for nbytes, k, ranks, item in replicated:
        if lowest_rank:
            r = ranks[0]
        elif (
            bytes_on_coordinator
            and item.type == WriteItemType.BYTE_IO
            and coordinator_rank in ranks
        ):
            r = coordinator_rank
        elif len(ranks) == world:
            while True:
                load, r = heap[0]
                if load == loads[r]:
                    break
                heapq.heapreplace(heap, (loads[r], r))
            heapq.heapreplace(heap, (load + nbytes, r))
        else:
            r = min(ranks, key=load_of)
        owner[k] = r
        loads[r] += nbytes
