"""Dedup over blocks of items shared by plans that differ elsewhere (DEDUP-14).

When every rank holds the same replicated items plus a few of its own, no two
local plans are equal and grouping whole plans (DEDUP-8) saves nothing. Each
local plan also carries digests of content-defined blocks of its items
(PLAN-15): a block listed by several ranks is looked at once, as a *unit* held
by all of them, so the coordinator's work grows with the distinct items, not
with ranks x items. The rule applied is DEDUP-1..7, unchanged: the result
equals :func:`~refdcp.reference.dedup.reference_dedup` however the
plans are cut into blocks.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, not_
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from refdcp.planning.dedup.duplicates import unit_duplicates
from refdcp.planning.dedup.greedy import (
    DedupResult,
    _disagreements,
    _suspects,
    assign_largest_first,
)
from refdcp.planning.local_plan import Blocks, ItemKey, chunk_nbytes

__all__ = ["dedup_by_blocks", "units_of", "valid_blocks"]

#: (each unit's items, its rep, per class its units in plan order, per class its block ends)
Units = tuple[list[Sequence[WriteItem]], list[int], list[list[int]], list[list[int]]]

_fqn = attrgetter("index.fqn")
_offset = attrgetter("index.offset")


def units_of(
    plans: Sequence[Sequence[WriteItem]],
    reps: list[int],
    blocks: Sequence[Blocks | None],
    whole: Sequence[Any],
) -> Units | None:
    """The distinct blocks of the class reps' plans, or None when no class shares one.

    Returns each unit's items, the rep (a rank listing it) and, per class, its
    units in plan order and where its blocks end. A rep without valid blocks is one block named by its
    plan digest ``whole[c]``. None also when a plan lists one block twice.
    """
    unit_of: dict[Any, int] = {}
    items_of: list[Sequence[WriteItem]] = []
    rep_of: list[int] = []
    class_of: list[int] = []
    units_by_class: list[list[int]] = []
    ends_by_class: list[list[int]] = []
    shared = False
    for c, rep in enumerate(reps):
        plan = plans[rep]
        cut: Any = blocks[c]
        if cut is None or not valid_blocks(cut, len(plan)):
            cut = ([len(plan)], [("plan", whole[c])]) if plan else ([], [])
        mine: list[int] = []
        listed: set[int] = set()
        start = 0
        for end, digest in zip(*cut):
            u = unit_of.setdefault(digest, len(items_of))
            if u == len(items_of):
                items_of.append(plan[start:end])
                rep_of.append(rep)
                class_of.append(c)
            elif u in listed:
                return None  # the same block twice in one plan: the class path handles it
            else:
                shared = True
            mine.append(u)
            listed.add(u)
            start = end
        units_by_class.append(mine)
        ends_by_class.append(list(cut[0]))
    return (items_of, rep_of, units_by_class, ends_by_class) if shared else None


def valid_blocks(cut: Any, n: int) -> bool:
    """Do these blocks cut a plan of ``n`` items into consecutive non-empty runs?"""
    if not isinstance(cut, (tuple, list)) or len(cut) != 2:
        return False
    ends, digests = cut
    if len(ends) != len(digests) or (ends[-1] if ends else 0) != n:
        return False
    return all(a < b for a, b in zip([0, *ends], ends))


def dedup_by_blocks(
    plans: Sequence[Sequence[WriteItem]],
    units: Units,
    members_of: list[list[int]],
    reps: list[int],
    sums: Sequence[Mapping[Any, int] | None],
    *,
    coordinator_rank: int,
    bytes_on_coordinator: bool,
    lowest_rank: bool,
) -> DedupResult:
    """DEDUP-1..7 over units (distinct blocks), each held by the ranks of the classes listing it."""
    world = len(plans)
    items_of, unit_rep, units_by_class, cut_ends = units
    nu = len(items_of)
    classes_of: list[list[int]] = [[] for _ in range(nu)]  # the classes listing each unit
    for c, us in enumerate(units_by_class):
        for u in us:
            classes_of[u].append(c)
    unit_members = [sorted(r for c in cs for r in members_of[c]) for cs in classes_of]
    keys_of = [list(zip(map(_fqn, items), map(_offset, items))) for items in items_of]
    counts = Counter(chain.from_iterable(keys_of))  # units holding each key
    masks = [[counts[k] > 1 for k in keys] for keys in keys_of]
    dups = unit_duplicates(keys_of, masks, classes_of, members_of)
    if dups:  # a plan listing a key twice: refused before any assignment (DEDUP-15)
        return DedupResult(plans=[list(p) for p in plans], problems=dups, class_reps=reps)
    # replicated keys (held by several units, or by a unit of several ranks), first seen first
    rep_item: dict[ItemKey, WriteItem] = {}
    owner: dict[ItemKey, int] = {}
    loads = [0] * world
    for u, (keys, items) in enumerate(zip(keys_of, items_of)):
        members = unit_members[u]
        if len(members) > 1:
            deque(map(rep_item.setdefault, keys, items), maxlen=0)
            continue
        r = members[0]
        lone = list(map(not_, masks[u]))
        owner.update(zip(compress(keys, lone), repeat(r)))  # DEDUP-5: held by r alone
        loads[r] += sum(map(chunk_nbytes, compress(items, lone)))
        deque(map(rep_item.setdefault, compress(keys, masks[u]), compress(items, masks[u])), 0)
    # units holding each key several units hold, and the screen of their replicas
    units_with: dict[ItemKey, list[int]] = {}
    for u, keys in enumerate(keys_of):
        for k in compress(keys, masks[u]):
            units_with.setdefault(k, []).append(u)
    suspects = _suspects(
        [list(compress(k, m)) for k, m in zip(keys_of, masks)],
        [list(compress(i, m)) for i, m in zip(items_of, masks)],
        [sums[r] for r in unit_rep],
    )
    first_unit: dict[ItemKey, int] = {}
    for u, keys in enumerate(keys_of):
        deque(map(first_unit.setdefault, keys, repeat(u)), maxlen=0)
    problems: list[str] = []
    item_of: dict[int, dict[ItemKey, WriteItem]] = {}
    union: dict[tuple[int, ...], list[int]] = {}
    replicated: list[tuple[int, ItemKey, list[int], WriteItem]] = []
    all_sums = list(sums)
    for k, item in rep_item.items():
        holding = units_with.get(k)
        if holding is None:
            ranks = unit_members[first_unit[k]]
        else:
            key_units = tuple(holding)
            if key_units not in union:
                union[key_units] = sorted(
                    set(chain.from_iterable(unit_members[u] for u in holding))
                )
            ranks = union[key_units]
            if k in suspects:
                for u in holding:
                    if u not in item_of:
                        item_of[u] = dict(zip(keys_of[u], items_of[u]))
                problems.extend(
                    _disagreements(k, holding, item_of, unit_members, unit_rep, all_sums)
                )
        replicated.append((chunk_nbytes(item), k, ranks, item))
    assign_largest_first(
        replicated, owner, loads, world, coordinator_rank, bytes_on_coordinator, lowest_rank
    )
    # per unit, the positions each of its ranks writes; then per rank, from its class rep's
    # own plan (the item objects the class path gives: the same pickled metadata, META-8)
    owner_get = owner.__getitem__
    positions: list[dict[int, list[int]]] = []
    for u, keys in enumerate(keys_of):
        members = unit_members[u]
        if len(members) == 1:
            r = members[0]
            mask = map(r.__eq__, map(owner_get, keys))
            positions.append({r: list(compress(range(len(keys)), mask))})
            continue
        mine = set(members)
        pos: dict[int, list[int]] = {}
        for i, r in enumerate(map(owner_get, keys)):
            if r in mine:
                pos.setdefault(r, []).append(i)
        positions.append(pos)
    out: list[list[WriteItem]] = [[] for _ in range(world)]
    for c, us in enumerate(units_by_class):
        plan = plans[reps[c]]
        starts = [0, *cut_ends[c]]
        for r in members_of[c]:
            parts = []
            for u, start in zip(us, starts):
                ix = positions[u].get(r)
                if ix:
                    parts.append(map(plan.__getitem__, map(start.__add__, ix)))
            out[r] = list(chain.from_iterable(parts))
    return DedupResult(plans=out, problems=problems, class_reps=reps)
