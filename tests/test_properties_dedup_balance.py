"""Dedup balance as a property, for items held by SOME ranks (HSDP / 2-D meshes) (DEDUP-1..3).

The greedy of DEDUP-2 visits replicated items largest first and gives each to
the least loaded of its holders. Whatever the order among equal-sized items, the
final loads then satisfy, for every rank ``r`` that was given replicated items:
some item ``i`` among ``r``'s smallest ones has, for each of its holders ``h``,
``final(r) - size(i) <= final(h)`` (``r``'s load before its last item was at most
``h``'s load then, and loads only grow). Giving items to the MOST loaded holder
breaks it (tests/test_properties_dedup_balance.py::test_most_loaded_rule_is_caught).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import WriteItem

import refdcp.planning.dedup.greedy as greedy_module
from refdcp.planning.dedup.classes import DedupResult, dedup_items
from refdcp.planning.local_plan import ItemKey, chunk_nbytes, item_key, plan_digest, save_items


def check_dedup(plans: Sequence[Sequence[WriteItem]], res: DedupResult) -> None:
    """DEDUP-1 (one writer, a holder), DEDUP-5 (lone items stay), DEDUP-2 (least loaded holder)."""
    holders: dict[ItemKey, list[int]] = defaultdict(list)
    size: dict[ItemKey, int] = {}
    for r, p in enumerate(plans):
        for i in p:
            holders[item_key(i)].append(r)
            size[item_key(i)] = chunk_nbytes(i)
    writer: dict[ItemKey, list[int]] = defaultdict(list)
    for r, p in enumerate(res.plans):
        for i in p:
            writer[item_key(i)].append(r)
    for k, hs in holders.items():
        assert len(writer[k]) == 1, f"{k} written by ranks {writer[k]} (held by {hs})"
        assert writer[k][0] in hs, f"{k} written by rank {writer[k][0]}, held by {hs}"
    final = res.rank_bytes()
    mine: dict[int, list[ItemKey]] = defaultdict(list)
    for k, hs in holders.items():
        if len(hs) > 1:
            mine[writer[k][0]].append(k)
    for r, keys in mine.items():
        smallest = min(size[k] for k in keys)
        last = [k for k in keys if size[k] == smallest]
        ok = [k for k in last if all(final[r] - smallest <= final[h] for h in holders[k] if h != r)]
        assert ok, (
            f"rank {r} ends with {final[r]} bytes; before its last replicated item "
            f"({smallest} bytes) it held {final[r] - smallest}, more than another holder of "
            f"every such item ends with: loads {final}, items {[(k, holders[k]) for k in last]}"
        )


def mesh_plans(
    replicas: int, shards: int, sizes: list[list[int]], own: list[int], full: list[int]
) -> list[list[WriteItem]]:
    """A 2-D mesh: rank ``rep * shards + s`` holds shard ``s``'s items (shared by ``replicas``
    ranks), the items every rank holds (``full``) and its own unreplicated tensor."""
    world = replicas * shards
    sds: list[dict[str, Any]] = [{} for _ in range(world)]
    for r in range(world):
        s = r % shards
        for j, n in enumerate(sizes[s]):
            sds[r][f"shard{s}.p{j}"] = torch.zeros(n, dtype=torch.uint8)
        for j, n in enumerate(full):
            sds[r][f"full.p{j}"] = torch.zeros(n, dtype=torch.uint8)
        sds[r][f"own{r}"] = torch.zeros(own[r], dtype=torch.uint8)
    return [save_items(sd) for sd in sds]


@st.composite
def meshes(draw: st.DrawFn) -> list[list[WriteItem]]:
    replicas = draw(st.integers(1, 4))
    shards = draw(st.integers(1, 4))
    world = replicas * shards
    sizes = [draw(st.lists(st.integers(0, 64), max_size=6)) for _ in range(shards)]
    own = draw(st.lists(st.integers(0, 200), min_size=world, max_size=world))
    full = draw(st.lists(st.integers(0, 64), max_size=3))
    plans = mesh_plans(replicas, shards, sizes, own, full)
    # and some items on arbitrary subsets of ranks
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    for j in range(draw(st.integers(0, 6))):
        holders = rng.sample(range(world), rng.randint(1, world))
        item = save_items({f"subset.p{j}": torch.zeros(rng.randint(0, 64), dtype=torch.uint8)})
        for r in holders:
            plans[r] = plans[r] + item
    return plans


@pytest.mark.spec("DEDUP-1", "DEDUP-2", "DEDUP-5")
@given(meshes())
def test_items_held_by_some_ranks_go_to_the_least_loaded_holder(
    plans: list[list[WriteItem]],
) -> None:
    res = dedup_items(plans)
    assert res.problems == []
    check_dedup(plans, res)


@pytest.mark.spec("DEDUP-2", "DEDUP-8")
@given(meshes())
def test_digests_and_grouping_do_not_change_the_balanced_assignment(
    plans: list[list[WriteItem]],
) -> None:
    res = dedup_items(plans, digests=[plan_digest(p) for p in plans])
    check_dedup(plans, res)
    plain = dedup_items(plans, digests=[f"r{r}" for r in range(len(plans))])
    assert [[item_key(i) for i in p] for p in plain.plans] == [
        [item_key(i) for i in p] for p in res.plans
    ]


@pytest.mark.spec("DEDUP-2", "DEDUP-3")
def test_hsdp_mesh_exact_assignment() -> None:
    # 2 replicas x 2 shards: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
    # Rank 0 already writes 100 own bytes, so both shard-0 items go to rank 2;
    # rank 3 writes 100 own bytes, so both shard-1 items go to rank 1.
    plans = mesh_plans(2, 2, [[40, 30], [40, 30]], own=[100, 0, 0, 100], full=[])
    res = dedup_items(plans)
    written = {item_key(i)[0]: r for r, p in enumerate(res.plans) for i in p}
    assert written == {
        "own0": 0,
        "own1": 1,
        "own2": 2,
        "own3": 3,
        "shard0.p0": 2,
        "shard0.p1": 2,
        "shard1.p0": 1,
        "shard1.p1": 1,
    }
    assert res.rank_bytes() == [100, 70, 70, 100]
    check_dedup(plans, res)


@pytest.mark.spec("DEDUP-3")
@given(meshes())
def test_items_held_by_every_rank_stay_under_the_lpt_bound(plans: list[list[WriteItem]]) -> None:
    # restricted to the items every rank holds plus each rank's own: DEDUP-3's bound
    world = len(plans)
    keys_per_rank = [{item_key(i) for i in p} for p in plans]
    everywhere = set.intersection(*keys_per_rank)
    counts: dict[ItemKey, int] = defaultdict(int)
    for ks in keys_per_rank:
        for k in ks:
            counts[k] += 1
    sub = [[i for i in p if item_key(i) in everywhere or counts[item_key(i)] == 1] for p in plans]
    res = dedup_items(sub)
    rep = [chunk_nbytes(i) for i in sub[0] if item_key(i) in everywhere] if world > 1 else []
    unique = [sum(chunk_nbytes(i) for i in p if counts[item_key(i)] == 1) for p in sub]
    if rep:
        bound = max(max(unique), (sum(rep) + sum(unique)) / world + max(rep))
        assert max(res.rank_bytes()) <= bound
    check_dedup(sub, res)


@pytest.mark.spec("HARN-10", "DEDUP-2")
def test_most_loaded_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deliberately wrong rule of issue 13 (most loaded holder) fails the property."""
    plans = mesh_plans(2, 2, [[40, 30], [40, 30]], own=[100, 0, 0, 100], full=[])
    check_dedup(plans, dedup_items(plans))  # the real rule passes
    monkeypatch.setattr(greedy_module, "min", max, raising=False)  # min(holders) -> max(holders)
    wrong = dedup_items(plans)
    assert wrong.rank_bytes() != [100, 70, 70, 100], "the injected rule did not take effect"
    with pytest.raises(AssertionError, match="before its last replicated item"):
        check_dedup(plans, wrong)


@pytest.mark.spec("DEDUP-4")
def test_disagreeing_replicas_are_found_in_plans_that_also_hold_objects() -> None:
    # the screen takes another path when a plan holds non-tensor items
    a = save_items({"w": torch.zeros(4), "obj": {"lr": 0.1}, "s": "x"})
    b = save_items({"w": torch.zeros(4, dtype=torch.float16), "obj": {"lr": 0.1}, "s": 3})
    res = dedup_items([a, b])
    assert any("'w'" in p and "dtype" in p for p in res.problems), res.problems
    c = save_items({"w": torch.zeros(5), "obj": {"lr": 0.1}})
    res = dedup_items([save_items({"w": torch.zeros(4), "obj": {"lr": 0.1}}), c])
    assert any("'w'" in p and "shape" in p for p in res.problems), res.problems
