"""The dedup rule: which rank writes each item that several ranks hold (DEDUP-1..7, DEDUP-15).

This is the rule itself; ``refdcp.planning``'s dedup is the same rule made fast
and is tested equal to :func:`reference_dedup` on any input (DEDUP-9).

0. A rank's plan lists each ``(fqn, chunk offsets)`` key at most once; if one
   does not, nothing is assigned and each such rank is named (DEDUP-15).
1. An item held by one rank stays there; its bytes count toward that rank's load.
2. Replicated items, largest chunk first (ties: the order in which the lowest
   holding rank lists them), each go to one holder: the lowest holder with
   ``lowest_rank``; else the coordinator for a non-tensor item it holds with
   ``bytes_on_coordinator``; else the holder with the fewest bytes so far
   (ties: the lowest rank). The writer's load grows by the item's bytes
   (chunk bytes; 1 for a non-tensor item).
3. Replicas of one item that disagree in kind, dtype or shape, or (given
   checksums) in value, are problems naming the ranks on each side.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["Decision", "ItemKey", "chunk_nbytes", "item_key", "reference_dedup"]

#: An item's identity across ranks: (fqn, chunk offsets or None for a non-tensor item).
ItemKey = tuple[str, Any]


@dataclass(frozen=True)
class Decision:
    """Who held one replicated item, who writes it, and why (TRACE-3)."""

    fqn: str
    offsets: tuple[int, ...]
    nbytes: int
    holders: list[int]
    writer: int
    reason: str


def item_key(item: WriteItem) -> ItemKey:
    """The key replicas of one item share (DEDUP-1)."""
    return (item.index.fqn, item.index.offset)


def chunk_nbytes(item: WriteItem) -> int:
    """Bytes of the item's chunk (not of the whole tensor); 1 for a non-tensor item (DEDUP-3)."""
    td = item.tensor_data
    if td is None:
        return 1
    itemsize = torch.empty((), dtype=td.properties.dtype).element_size()
    return math.prod(td.chunk.sizes) * itemsize


def reference_dedup(
    plans: Sequence[Sequence[WriteItem]],
    *,
    checksums: Sequence[Mapping[Any, int] | None] | None = None,
    coordinator_rank: int = 0,
    bytes_on_coordinator: bool = True,
    lowest_rank: bool = False,
) -> tuple[list[list[WriteItem]], list[str], list[Decision]]:
    """(per-rank kept items, problems, one decision per replicated item) (DEDUP-1..7)."""
    sums = list(checksums) if checksums is not None else [None] * len(plans)
    duplicates = duplicate_problems(plans)
    if duplicates:  # rule 0 (DEDUP-15)
        return [list(p) for p in plans], duplicates, []
    holders: dict[ItemKey, dict[int, WriteItem]] = {}
    for rank, plan in enumerate(plans):
        for item in plan:
            holders.setdefault(item_key(item), {})[rank] = item

    writer: dict[ItemKey, int] = {}
    loads = [0] * len(plans)
    for key, replicas in holders.items():  # rule 1 (DEDUP-5)
        if len(replicas) == 1:
            ((rank, item),) = replicas.items()
            writer[key] = rank
            loads[rank] += chunk_nbytes(item)

    replicated = [key for key, replicas in holders.items() if len(replicas) > 1]
    by_size = sorted(replicated, key=lambda k: -chunk_nbytes(next(iter(holders[k].values()))))
    decisions = []
    for key in by_size:  # rule 2 (DEDUP-2, DEDUP-3, DEDUP-7)
        ranks = list(holders[key])
        item = holders[key][ranks[0]]
        w, reason = _choose_writer(
            item, ranks, loads, coordinator_rank, bytes_on_coordinator, lowest_rank
        )
        writer[key] = w
        loads[w] += chunk_nbytes(item)
        offsets = tuple(int(o) for o in (key[1] or ()))
        decisions.append(Decision(key[0], offsets, chunk_nbytes(item), ranks, w, reason))

    problems = []
    for key in replicated:  # rule 3, in listing order (DEDUP-4, DEDUP-6)
        problems += _disagreements(key, holders[key], sums)
    kept = [[i for i in plan if writer[item_key(i)] == rank] for rank, plan in enumerate(plans)]
    return kept, problems, decisions


def _choose_writer(
    item: WriteItem,
    ranks: list[int],
    loads: list[int],
    coordinator_rank: int,
    bytes_on_coordinator: bool,
    lowest_rank: bool,
) -> tuple[int, str]:
    """Rule 2 for one replicated item: the writer and the reason (DEDUP-2, DEDUP-7)."""
    if lowest_rank:
        return ranks[0], "lowest holding rank (dedup_save_to_lowest_rank)"
    if bytes_on_coordinator and item.type == WriteItemType.BYTE_IO and coordinator_rank in ranks:
        return coordinator_rank, "non-tensor item: kept on the coordinator so loads read one file"
    w = min(ranks, key=lambda r: (loads[r], r))
    named = ", ".join(f"r{r}={loads[r]}" for r in ranks)
    return w, f"fewest bytes so far among holders ({loads[w]} B; {named})"


def duplicate_problems(plans: Sequence[Sequence[WriteItem]]) -> list[str]:
    """One problem per rank whose plan lists a key twice, naming its smallest (DEDUP-15)."""
    problems = []
    for rank, plan in enumerate(plans):
        counts = Counter(item_key(i) for i in plan)
        twice = sorted(_ordered(k) for k, n in counts.items() if n > 1)
        if twice:
            fqn, offsets = twice[0]
            more = f" and {len(twice) - 1} more key(s)" if len(twice) > 1 else ""
            problems.append(
                f"rank {rank}'s local plan lists {fqn!r} chunk at offsets {offsets}{more} more "
                "than once; a planner must list each chunk once (DEDUP-15)"
            )
    return problems


def _ordered(key: ItemKey) -> tuple[str, tuple[int, ...]]:
    return (key[0], tuple(int(o) for o in (key[1] or ())))


def _disagreements(
    key: ItemKey, replicas: Mapping[int, WriteItem], sums: Sequence[Mapping[Any, int] | None]
) -> list[str]:
    """Replicas that differ in kind, dtype or shape (DEDUP-4), else in value (DEDUP-6)."""
    fqn, off = key
    where = f"{fqn!r}" + ("" if off is None else f" chunk at offsets {tuple(off)}")
    by_shape: dict[Any, list[int]] = {}
    for rank, item in replicas.items():
        by_shape.setdefault(_shape_of(item), []).append(rank)
    if len(by_shape) > 1:
        desc = "; ".join(f"ranks {rs} hold {_describe(s)}" for s, rs in by_shape.items())
        return [f"replicas of {where} disagree in type, dtype or shape: {desc}"]
    by_sum: dict[int, list[int]] = {}
    for rank in replicas:
        value = None if sums[rank] is None else sums[rank].get(key)  # type: ignore[union-attr]
        if value is not None:
            by_sum.setdefault(value, []).append(rank)
    if len(by_sum) > 1:
        desc = "; ".join(f"ranks {rs} hold checksum {s:#010x}" for s, rs in by_sum.items())
        return [f"replicas of {where} differ in value between ranks: {desc}"]
    return []


def _shape_of(item: WriteItem) -> tuple[Any, ...]:
    """What replicas must agree on: kind, chunk shape, dtype, global shape (DEDUP-4)."""
    td = item.tensor_data
    if td is None:
        return (item.type.value,)
    return (item.type.value, tuple(td.chunk.sizes), str(td.properties.dtype), tuple(td.size))


def _describe(shape: tuple[Any, ...]) -> str:
    if len(shape) == 1:
        return "a non-tensor object"
    kinds = {WriteItemType.TENSOR.value: "tensor", WriteItemType.SHARD.value: "shard"}
    kind = kinds.get(shape[0], "item")
    return f"a {kind} of chunk shape {shape[1]}, dtype {shape[2]}, global shape {shape[3]}"
