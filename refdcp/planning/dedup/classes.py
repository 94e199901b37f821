"""Dedup of replicated write items (spec/planning.md, DEDUP-*).

Ranks whose local plans have the same digest are handled once, as a class, so
128 ranks holding the same replicated items cost one pass over those items;
per-rank filtering then runs in C (``itertools.compress``) (DEDUP-8).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter, not_
from typing import Any

import numpy as np
from torch.distributed.checkpoint.planner import WriteItem

from refdcp.planning.dedup.duplicates import class_duplicates
from refdcp.planning.dedup.greedy import (
    DedupResult,
    _disagreements,
    _suspects,
    assign_largest_first,
)
from refdcp.planning.local_plan import Blocks, ItemKey, chunk_nbytes, plan_digest
from refdcp.planning.metadata.dense_ids import DenseIds, dense_ids, dense_ids_of_names

__all__ = ["DedupResult", "dedup_items"]

_fqn = attrgetter("index.fqn")
_offset = attrgetter("index.offset")
_td = attrgetter("tensor_data")


def dedup_items(
    plans: Sequence[Sequence[WriteItem]],
    *,
    digests: Sequence[str | None] | None = None,
    checksums: Sequence[Mapping[Any, int] | None] | None = None,
    coordinator_rank: int = 0,
    bytes_on_coordinator: bool = True,
    lowest_rank: bool = False,
    blocks: Sequence[Blocks | None] | None = None,
) -> DedupResult:
    """Keep each (fqn, chunk) on exactly one of the ranks that hold it (DEDUP-1..7).

    Replicated items are assigned largest chunk first to the least loaded
    holder (ties: lowest rank), after each rank's unreplicated bytes are
    counted (DEDUP-2, DEDUP-3). With ``bytes_on_coordinator`` non-tensor items
    held by the coordinator stay there (DEDUP-7). Replicas that disagree in
    type, dtype or shape, or (when ``checksums`` are given) in value, are
    problems (DEDUP-4, DEDUP-6). ``blocks`` (per rank, from
    :func:`~refdcp.planning.local_plan.block_digests`) let plans that differ share
    the work of their common blocks (DEDUP-14); they never change the result.
    """
    world = len(plans)
    sums: list[Mapping[Any, int] | None] = (
        list(checksums) if checksums is not None else [None] * world
    )
    digs = list(digests) if digests is not None else [None] * world
    # 1. classes of ranks with identical plans
    classes: dict[str, list[int]] = {}
    for r in range(world):
        d = digs[r] or plan_digest(plans[r], sums[r])
        classes.setdefault(d, []).append(r)
    reps = [members[0] for members in classes.values()]
    members_of = list(classes.values())
    if blocks is not None and len(reps) > 1:  # plans that differ may still share blocks
        from refdcp.planning.dedup.blocks import dedup_by_blocks, units_of

        units = units_of(plans, reps, [blocks[r] for r in reps], list(classes))
        if units is not None:
            return dedup_by_blocks(
                plans,
                units,
                members_of,
                reps,
                sums,
                coordinator_rank=coordinator_rank,
                bytes_on_coordinator=bytes_on_coordinator,
                lowest_rank=lowest_rank,
            )
    # 2. keys held by several classes: none at all (sharded plans) is found with numpy
    # over integer ids; else counted in C (Counter over all keys)
    distinct = _keys_distinct([plans[rep] for rep in reps])
    out: list[list[WriteItem]] = [[] for _ in range(world)]
    # classes whose items no other class holds are independent greedies: solved per
    # pattern of chunk sizes, once for all classes sharing it (DEDUP-12)
    done = _split_independent_classes(plans, reps, members_of, out, lowest_rank) if distinct else []
    keys_of: list[list[ItemKey]] = [
        list(zip(map(_fqn, plans[rep]), map(_offset, plans[rep])))
        if not distinct or (len(members) > 1 and not done[c])
        else []  # a lone rank's keys are not needed when no key is shared
        for c, (rep, members) in enumerate(zip(reps, members_of))
    ]
    if not distinct:  # a plan listing a key twice: refused before any assignment (DEDUP-15)
        dups = class_duplicates(keys_of, members_of)
        if dups:
            return DedupResult(plans=[list(p) for p in plans], problems=dups, class_reps=reps)
    counts = Counter() if distinct else Counter(chain.from_iterable(keys_of))
    shared = set() if distinct else {k for k, n in counts.items() if n > 1}
    # per class, which of its keys other classes hold too: computed once, used by steps 3-4
    masks = [list(map(shared.__contains__, keys)) for keys in keys_of] if shared else []
    # and those keys with their items (other classes' replicas are compared with them)
    shared_keys = [list(compress(keys, m)) for keys, m in zip(keys_of, masks)]
    shared_items = [list(compress(plans[rep], m)) for rep, m in zip(reps, masks)]
    owner: dict[ItemKey, int] = {}
    for c, keys in enumerate(keys_of):
        if len(members_of[c]) == 1 and shared:  # a lone rank writes the keys only it holds
            owner.update(zip(compress(keys, map(not_, masks[c])), repeat(members_of[c][0])))
    # 3. replicated keys: held by a class of several ranks, or by several classes
    # first holder of each replicated key and its item, recorded in C (dict.setdefault)
    first_class: dict[ItemKey, int] = {}
    rep_item: dict[ItemKey, WriteItem] = {}
    ncls = len(keys_of)
    for c, keys in enumerate(keys_of):
        items = plans[reps[c]]
        if done and done[c]:
            continue
        if len(members_of[c]) > 1:
            sel_keys: Iterable[ItemKey] = keys
            sel_items: Iterable[WriteItem] = items
        elif shared:
            sel_keys, sel_items = shared_keys[c], shared_items[c]
        else:
            continue
        deque(map(first_class.setdefault, sel_keys, repeat(c)), maxlen=0)
        deque(map(rep_item.setdefault, sel_keys, sel_items), maxlen=0)
    # classes of keys held by some but not all classes (rare), gathered per key
    partial = {k for k, n in counts.items() if 1 < n < ncls} if shared else set()
    some_classes: dict[ItemKey, list[int]] = {}
    if partial:
        for c, keys in enumerate(keys_of):
            for k in compress(keys, map(partial.__contains__, keys)):
                some_classes.setdefault(k, []).append(c)
    all_classes = list(range(ncls))
    problems: list[str] = []
    item_of: dict[int, dict[ItemKey, WriteItem]] = {}
    replicated: list[tuple[int, ItemKey, list[int], WriteItem]] = []
    suspects = _suspects(shared_keys, shared_items, [sums[r] for r in reps])
    every_rank = sorted(r for members in members_of for r in members)
    for k, item in rep_item.items():
        n = 1 if distinct else counts[k]
        if n == 1:
            ranks = members_of[first_class[k]]
        else:
            cls = all_classes if n == ncls else some_classes[k]
            if k in suspects:  # the worded check runs only where the screen found a difference
                for c in cls:
                    if c not in item_of:
                        item_of[c] = dict(zip(keys_of[c], plans[reps[c]]))
                problems.extend(_disagreements(k, cls, item_of, members_of, reps, sums))
            ranks = every_rank if n == ncls else sorted(r for c in cls for r in members_of[c])
        replicated.append((chunk_nbytes(item), k, ranks, item))
    # 4. largest-first greedy over replicated keys, after the unreplicated bytes
    loads = [0] * world
    if replicated:
        for c, members in enumerate(members_of):
            if len(members) == 1:
                items = plans[reps[c]]
                # a lone rank's own bytes: every item no other class holds
                own = compress(items, map(not_, masks[c])) if shared else items
                loads[members[0]] = sum(map(chunk_nbytes, own))
    assign_largest_first(
        replicated,
        owner,
        loads,
        world,
        coordinator_rank,
        bytes_on_coordinator,
        lowest_rank,
    )
    # 5. per-rank plans: one pass per class, C-level filtering for single ranks
    owner_get = owner.__getitem__
    for c, members in enumerate(members_of):
        if done and done[c]:
            continue
        items = plans[reps[c]]
        keys = keys_of[c]
        if len(members) == 1:
            r = members[0]
            if shared:
                out[r] = list(compress(items, map(r.__eq__, map(owner_get, keys))))
            else:
                out[r] = list(items)
            continue
        mine = set(members)
        for k, item in zip(keys, items):
            r = owner_get(k)
            if r in mine:
                out[r].append(item)
    return DedupResult(plans=out, problems=problems, class_reps=reps)


_nbytes_sig = attrgetter("tensor_data.chunk.sizes", "tensor_data.properties.dtype")
#: a pattern: for each holder (by position among the class's ranks), an itemgetter of the
#: positions of the items it writes (None: none; an int: exactly one)
_Pattern = list[Any]


def _split_independent_classes(
    plans: Sequence[Sequence[WriteItem]],
    reps: list[int],
    members_of: list[list[int]],
    out: list[list[WriteItem]],
    lowest_rank: bool,
) -> list[bool]:
    """Dedup each class of several ranks whose tensor items no other class holds (DEDUP-12).

    Called only when no key is held by two classes (HSDP: each shard's ranks form
    one class). Such a class's greedy touches only its own ranks, whose loads start
    at zero, so it is the global greedy restricted to the class; classes with the
    same chunk sizes and dtypes in the same order (every shard of an HSDP mesh) get the
    same assignment by position, computed once. Fills ``out`` for those classes and
    returns which classes it handled.
    """
    done = [False] * len(reps)
    patterns: dict[Any, _Pattern] = {}
    for c, (rep, members) in enumerate(zip(reps, members_of)):
        items = plans[rep]
        if len(members) < 2 or not all(map(_td, items)):  # objects: the general path
            continue
        sig = (len(members), tuple(map(_nbytes_sig, items)))
        pattern = patterns.get(sig)
        if pattern is None:
            pattern = patterns[sig] = _class_pattern(items, len(members), lowest_rank)
        for r, get in zip(members, pattern):
            if get is None:
                continue
            out[r] = [items[get]] if isinstance(get, int) else list(get(items))
        done[c] = True
    return done


def _class_pattern(items: Sequence[WriteItem], m: int, lowest_rank: bool) -> _Pattern:
    """DEDUP-2's greedy over one class's items and ``m`` holders with no other load."""
    sizes = list(map(chunk_nbytes, items))
    order = sorted(range(len(items)), key=lambda i: -sizes[i])  # stable: listing order on ties
    heap = [(0, j) for j in range(m)]  # (load, holder): the least loaded, ties the lowest rank
    mine: list[list[int]] = [[] for _ in range(m)]
    writer = [0] * len(items)
    for i in order:
        if lowest_rank:
            continue  # every item to the lowest rank (writer 0)
        load, j = heap[0]
        writer[i] = j
        heapq.heapreplace(heap, (load + sizes[i], j))
    for i, j in enumerate(writer):
        mine[j].append(i)
    return [None if not ix else ix[0] if len(ix) == 1 else itemgetter(*ix) for ix in mine]


def _keys_distinct(plans: Sequence[Sequence[WriteItem]]) -> bool:
    """Is every (fqn, offset) key of these plans held once? Numpy over dense ids (DEDUP-8)."""
    n = sum(map(len, plans))
    if n < 2:
        return True
    firsts = [(p[0].index.fqn, p[0].index.offset) for p in plans if p]
    if len(set(firsts)) < len(firsts):  # replicated plans usually share their first key
        return False
    fqns, f = dense_ids_of_names(list(chain.from_iterable(map(_fqn, p) for p in plans)))
    offsets = DenseIds()
    o = dense_ids(offsets, chain.from_iterable(map(_offset, p) for p in plans), n)
    keys = np.sort(o.astype(np.int64) * len(fqns) + f, kind="stable")
    return not bool((keys[1:] == keys[:-1]).any())
