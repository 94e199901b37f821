"""Local plans that list one chunk twice are refused before dedup (DEDUP-15).

Dedup assumes each rank lists each (FQN, chunk offset) key at most once; refdcp's
own local plans do, a custom planner's may not. Given such a plan, the assignment
could leave the key to no writer at all, and the save would commit a checkpoint
without it. So every dedup path (the reference, whole-plan classes, blocks)
reports it first, as one problem per rank naming the key, and assigns nothing.
The checks cost one set per distinct plan (or per distinct block): replicas of a
plan are looked at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import compress

from refdcp.planning.local_plan import ItemKey

__all__ = ["class_duplicates", "duplicate_problems", "repeated_keys", "unit_duplicates"]


def repeated_keys(keys: Sequence[ItemKey]) -> set[ItemKey]:
    """The keys listed more than once in ``keys`` (empty in the common case, in C)."""
    if len(set(keys)) == len(keys):
        return set()
    return {k for k, n in Counter(keys).items() if n > 1}


def _order(key: ItemKey) -> tuple[str, tuple[int, ...]]:
    return (key[0], tuple(int(o) for o in (key[1] or ())))


def duplicate_problems(per_rank: Iterable[tuple[int, Iterable[ItemKey]]]) -> list[str]:
    """One problem per rank whose plan lists keys twice, in rank order (DEDUP-15)."""
    out: list[tuple[int, str]] = []
    for rank, keys in per_rank:
        dups = sorted(set(keys), key=_order)
        if not dups:
            continue
        fqn, offsets = _order(dups[0])
        more = f" and {len(dups) - 1} more key(s)" if len(dups) > 1 else ""
        out.append(
            (
                rank,
                f"rank {rank}'s local plan lists {fqn!r} chunk at offsets {offsets}{more} more "
                "than once; a planner must list each chunk once (DEDUP-15)",
            )
        )
    return [msg for _, msg in sorted(out, key=lambda x: x[0])]


def class_duplicates(
    keys_of: Sequence[Sequence[ItemKey]], members_of: Sequence[list[int]]
) -> list[str]:
    """Duplicate-key problems of whole-plan classes: each distinct plan checked once."""
    found: list[tuple[int, Iterable[ItemKey]]] = []
    for keys, members in zip(keys_of, members_of):
        dups = repeated_keys(keys)
        if dups:
            found.extend((r, dups) for r in members)
    return duplicate_problems(found) if found else []


def unit_duplicates(
    keys_of: Sequence[Sequence[ItemKey]],
    masks: Sequence[Sequence[bool]],
    classes_of: Sequence[Sequence[int]],
    members_of: Sequence[list[int]],
) -> list[str]:
    """Duplicate-key problems over distinct blocks (units, DEDUP-14).

    A key twice in one unit is found per unit; a key in two units that one class
    lists (a class lists each unit at most once) among the keys several units hold
    (``masks``). ``classes_of[u]``: the classes listing unit ``u``.
    """
    per_class: dict[int, set[ItemKey]] = {}
    seen: dict[tuple[int, ItemKey], int] = {}  # (class, key) -> the unit it came from
    for u, (keys, mask) in enumerate(zip(keys_of, masks)):
        dups = repeated_keys(keys)
        for c in classes_of[u]:
            if dups:
                per_class.setdefault(c, set()).update(dups)
            for k in compress(keys, mask):
                if seen.setdefault((c, k), u) != u:
                    per_class.setdefault(c, set()).add(k)
    if not per_class:
        return []
    return duplicate_problems((r, keys) for c, keys in per_class.items() for r in members_of[c])
