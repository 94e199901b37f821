"""The plan cache's grouping of ranks (PLAN-10), built by ``GlobalPlanCache.build``.

A cached save compares replica digests "through the cached grouping of ranks": ranks
whose plan digests are equal form one class and must have equal digests; a key held
by ranks of several classes must have one digest across them. Here the grouping is
checked against its documented meaning, and the whole cached check (``build`` then
``replicas_agree``) against DEDUP-13 stated plainly over the plans themselves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from refdcp.planning.plan_cache import GlobalPlanCache

_KEYS: list[tuple[str, torch.Size | None]] = [
    ("w", torch.Size([0])),
    ("w", torch.Size([4])),
    ("b", None),
    ("c", None),
]


def _plan(keys: tuple[int, ...]) -> SavePlan:
    items = []
    for i in keys:
        fqn, off = _KEYS[i]
        kind = WriteItemType.BYTE_IO if off is None else WriteItemType.SHARD
        items.append(WriteItem(index=MetadataIndex(fqn, off), type=kind))
    return SavePlan(items=items)


Case = tuple[list[tuple[int, ...]], list[Any], list[dict[Any, int] | None]]


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    world = draw(st.integers(1, 4))
    key_sets = st.lists(st.integers(0, len(_KEYS) - 1), max_size=3, unique=True).map(tuple)
    pool = draw(st.lists(key_sets, min_size=1, max_size=3))
    plans = [draw(st.sampled_from(pool)) for _ in range(world)]
    # the digest names the plan; the coordinator (and any rank here) may send none
    digests: list[Any] = [
        None if draw(st.integers(0, 3)) == 0 else ("digest", plans[r]) for r in range(world)
    ]
    sums: list[dict[Any, int] | None] = []
    for r in range(world):
        if draw(st.integers(0, 9)) == 0:
            sums.append(None)
            continue
        held = [_KEYS[i] for i in plans[r]]
        sums.append({k: draw(st.integers(0, 1)) for k in held if draw(st.integers(0, 5))})
    return plans, digests, sums


def _rule(plans: list[tuple[int, ...]], digests: list[Any], sums: list[Any]) -> bool:
    """DEDUP-13 through the grouping: ranks with one plan digest have equal digests, and
    every key has one digest (a missing one counts as a value) over all ranks holding it."""
    world = len(plans)
    for r in range(world):
        for q in range(r):
            if digests[r] is not None and digests[q] == digests[r] and sums[q] != sums[r]:
                return False
    for i in range(len(_KEYS)):
        holders = [r for r in range(world) if i in plans[r]]
        vals = {None if sums[r] is None else sums[r].get(_KEYS[i]) for r in holders}
        if len(vals) > 1:
            return False
    return True


def _build(plans: list[tuple[int, ...]], digests: list[Any]) -> GlobalPlanCache:
    extras = [{"digest": d, "fingerprint": r} for r, d in enumerate(digests)]
    all_plans = [_plan(p) for p in plans]
    return GlobalPlanCache.build(all_plans, extras, all_plans, None)  # type: ignore[arg-type]


@pytest.mark.spec("PLAN-10", "DEDUP-13")
@settings(max_examples=300)  # cheap examples
@given(_cases())
@example(  # two classes holding one key with two digests
    ([(0,), (0,)], [("digest", (0,)), None], [{_KEYS[0]: 0}, {_KEYS[0]: 1}])
)
@example(  # two ranks without a plan digest are two classes, not one
    ([(2,), (3,)], [None, None], [{_KEYS[2]: 0}, {_KEYS[3]: 1}])
)
def test_the_cached_check_is_dedup_13_over_the_plans(case: Case) -> None:
    plans, digests, sums = case
    # ranks of one class hold one plan; their digests of it are what replicas_agree compares
    assert bool(_build(plans, digests).replicas_agree(sums)) == _rule(plans, digests, sums)


@pytest.mark.spec("PLAN-10")
@settings(max_examples=200)  # cheap examples
@given(_cases())
@example(([(0,), (1,)], [None, None], [None, None]))  # keys held by one class rep only
def test_the_grouping_is_what_its_fields_say(case: Case) -> None:
    """``ref``: the lowest rank with the same plan digest (itself without one); ``cross``: each
    key held by two or more class reps, under the ascending tuple of those reps."""
    plans, digests, _ = case
    cache = _build(plans, digests)
    world = len(plans)
    ref = [
        next(q for q in range(r + 1) if q == r or (d is not None and digests[q] == d))
        for r, d in enumerate(digests)
    ]
    assert cache.ref == ref
    assert cache.fingerprint_ids == list(range(world))
    reps = [r for r in range(world) if ref[r] == r]
    cross: dict[tuple[int, ...], list[Any]] = {}
    for i in range(len(_KEYS)):
        holders = tuple(r for r in reps if i in plans[r])
        if len(holders) > 1:
            cross.setdefault(holders, []).append(_KEYS[i])
    got = {rs: sorted(ks, key=repr) for rs, ks in cache.cross.items()}
    assert got == {rs: sorted(ks, key=repr) for rs, ks in cross.items()}
