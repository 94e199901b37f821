"""The dedup rule, written to be read: one record per replicated item (DEDUP-9, DEDUP-10).

:func:`reference_dedup` is the specification of :func:`~refdcp.planning.dedup.classes.dedup_items`
in executable form, with no speed tricks: a property test checks that the
fast version gives the same plans and problems on any input (DEDUP-9), and
``refdcp trace`` shows its :class:`Decision` records (TRACE-7).

The rule (DEDUP-1..7, after DEDUP-15's check that no rank lists a chunk twice):

1. An item held by one rank stays there; its bytes count toward that rank's load.
2. Replicated items, largest chunk first (ties: the order in which the lowest
   holding rank lists them), each go to one holder:
   the lowest holder with ``lowest_rank``; else the coordinator for a
   non-tensor item it holds with ``bytes_on_coordinator``; else the holder
   with the fewest bytes so far (ties: the lowest rank). The writer's load
   grows by the item's bytes (chunk bytes; 1 for a non-tensor item).
3. Replicas of one item that disagree in kind, dtype or shape, or (given
   checksums) in value, are problems naming the ranks on each side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from refdcp.planning.dedup.duplicates import duplicate_problems, repeated_keys
from refdcp.planning.local_plan import ItemKey, _signature, chunk_nbytes, item_key

__all__ = ["Decision", "reference_dedup"]


@dataclass(frozen=True)
class Decision:
    """Who held one replicated item, who writes it, and why (TRACE-3)."""

    fqn: str
    offsets: tuple[int, ...]
    nbytes: int
    holders: list[int]
    writer: int
    reason: str


def reference_dedup(
    plans: Sequence[Sequence[WriteItem]],
    *,
    checksums: Sequence[Mapping[Any, int] | None] | None = None,
    coordinator_rank: int = 0,
    bytes_on_coordinator: bool = True,
    lowest_rank: bool = False,
) -> tuple[list[list[WriteItem]], list[str], list[Decision]]:
    """(per-rank kept items, problems, one decision per replicated item)."""
    world = len(plans)
    sums = list(checksums) if checksums is not None else [None] * world
    dups = duplicate_problems(
        (r, repeated_keys(list(map(item_key, p)))) for r, p in enumerate(plans)
    )
    if dups:  # rule 0: each rank lists each chunk once (DEDUP-15); nothing is assigned
        return [list(p) for p in plans], dups, []
    holders: dict[ItemKey, list[int]] = {}
    replicas: dict[ItemKey, dict[int, WriteItem]] = {}
    for rank, plan in enumerate(plans):
        for item in plan:
            key = item_key(item)
            holders.setdefault(key, []).append(rank)
            replicas.setdefault(key, {})[rank] = item

    writer: dict[ItemKey, int] = {}
    loads = [0] * world
    for key, hs in holders.items():  # rule 1
        if len(hs) == 1:
            writer[key] = hs[0]
            loads[hs[0]] += chunk_nbytes(replicas[key][hs[0]])

    replicated = [key for key, hs in holders.items() if len(hs) > 1]
    replicated.sort(key=lambda key: -chunk_nbytes(replicas[key][holders[key][0]]))  # stable
    decisions: list[Decision] = []
    problems: list[str] = []
    for key in replicated:  # rule 2
        hs = holders[key]
        item = replicas[key][hs[0]]
        nbytes = chunk_nbytes(item)
        before = {h: loads[h] for h in hs}
        if lowest_rank:
            w, reason = hs[0], "lowest holding rank (dedup_save_to_lowest_rank)"
        elif bytes_on_coordinator and item.type == WriteItemType.BYTE_IO and coordinator_rank in hs:
            w, reason = (
                coordinator_rank,
                "non-tensor item: kept on the coordinator so loads read one file",
            )
        else:
            w = min(hs, key=lambda h: (loads[h], h))
            named = ", ".join(f"r{h}={b}" for h, b in before.items())
            reason = f"fewest bytes so far among holders ({before[w]} B; {named})"
        writer[key] = w
        loads[w] += nbytes
        offsets = tuple(int(o) for o in (key[1] or ()))
        decisions.append(Decision(key[0], offsets, nbytes, list(hs), w, reason))
    for key in [k for k, hs in holders.items() if len(hs) > 1]:  # rule 3, in listing order
        problems += _disagreements(key, replicas[key], sums)

    kept = [[item for item in plan if writer[item_key(item)] == r] for r, plan in enumerate(plans)]
    return kept, problems, decisions


def _disagreements(
    key: ItemKey, replicas: Mapping[int, WriteItem], sums: Sequence[Mapping[Any, int] | None]
) -> list[str]:
    fqn, off = key
    where = f"{fqn!r}" + ("" if off is None else f" chunk at offsets {tuple(off)}")
    by_sig: dict[Any, list[int]] = {}
    for rank, item in replicas.items():
        by_sig.setdefault(_signature(item)[2:], []).append(rank)
    if len(by_sig) > 1:
        desc = "; ".join(f"ranks {rs} hold {_describe(sig)}" for sig, rs in by_sig.items())
        return [f"replicas of {where} disagree in type, dtype or shape: {desc}"]
    by_sum: dict[int, list[int]] = {}
    for rank in replicas:
        s = sums[rank]
        value = None if s is None else s.get(key)
        if value is not None:
            by_sum.setdefault(value, []).append(rank)
    if len(by_sum) > 1:
        desc = "; ".join(f"ranks {rs} hold checksum {s:#010x}" for s, rs in by_sum.items())
        return [f"replicas of {where} differ in value between ranks: {desc}"]
    return []


def _describe(sig: tuple[Any, ...]) -> str:
    if len(sig) == 1:
        return "a non-tensor object"
    kind = {WriteItemType.TENSOR.value: "tensor", WriteItemType.SHARD.value: "shard"}.get(
        sig[0], "item"
    )
    return f"a {kind} of chunk shape {sig[1]}, dtype {sig[2]}, global shape {sig[3]}"
