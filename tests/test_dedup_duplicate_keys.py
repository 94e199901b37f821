"""A local plan listing one chunk twice is refused, never half-assigned (DEDUP-15).

Found by mutation testing (issue 13): given such a plan, the fast dedup could leave
the key to no writer, and the save committed a checkpoint without it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from refdcp.errors import CheckpointError
from refdcp.planning import DefaultSavePlanner
from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.local_plan import block_digests, item_key, save_items
from refdcp.reference.dedup import reference_dedup

SINGLE_PATH = "pins the fast dedup's handling of a chunk listed twice (DEDUP-15); the reference's dedup is tested equal to it (REF-4)"


def _plan(names: list[str]) -> list[WriteItem]:
    """Items named ``names`` in that order (a repeated name is a repeated key)."""
    items = {i.index.fqn: i for i in save_items({n: torch.zeros(4) for n in set(names)})}
    return [items[n] for n in names]


def _both(plans: list[list[WriteItem]], blocks: Any = None) -> tuple[Any, list[str]]:
    fast = dedup_items(plans, blocks=blocks)
    kept, problems, decisions = reference_dedup(plans)
    assert fast.plans == kept and fast.problems == problems
    if problems:
        assert decisions == []  # nothing was assigned
    return fast, problems


@pytest.mark.spec("DEDUP-15", "DEDUP-9")
def test_a_key_listed_twice_is_named_not_left_to_no_writer() -> None:
    """The case the mutation run found: rank 0 lists ``a`` twice, rank 1 once, rank 2 not."""
    plans = [_plan(["a", "a", "o0"]), _plan(["a", "o1"]), _plan(["c"])]
    fast, problems = _both(plans)
    assert problems == [
        "rank 0's local plan lists 'a' chunk at offsets (0,) more than once; "
        "a planner must list each chunk once (DEDUP-15)"
    ]
    assert fast.plans == plans  # returned as given: nothing is assigned


@pytest.mark.spec("DEDUP-15", "DEDUP-8")
def test_every_rank_of_a_class_listing_keys_twice_is_named() -> None:
    plans = [_plan(["x", "b", "a", "b", "a"])] * 3 + [_plan(["x"])]
    _, problems = _both(plans)
    assert problems == [
        f"rank {r}'s local plan lists 'a' chunk at offsets (0,) and 1 more key(s) more than "
        "once; a planner must list each chunk once (DEDUP-15)"
        for r in range(3)
    ]


@pytest.mark.spec("DEDUP-15", "DEDUP-14")
@pytest.mark.parametrize("ends", [[3], [2, 3], [1, 3]], ids=["one-block", "across", "first"])
def test_the_block_path_finds_a_key_twice_in_a_block_or_across_blocks(ends: list[int]) -> None:
    """Ranks 1 and 2 share a block (so the block path runs); rank 0 lists ``a`` twice,
    inside one of its blocks or in two of them."""
    shared = ["s0", "s1", "s2"]
    plans = [_plan(["a", "x", "a"]), _plan([*shared, "own1"]), _plan([*shared, "own2"])]
    blocks: list[Any] = [block_digests(plans[0], None, ends)]
    blocks += [block_digests(p, None, [3, 4]) for p in plans[1:]]
    assert blocks[1][1][0] == blocks[2][1][0]
    _, problems = _both(plans, blocks)
    assert len(problems) == 1 and problems[0].startswith("rank 0's local plan lists 'a'")


@st.composite
def worlds_with_repeats(draw: st.DrawFn) -> tuple[list[list[WriteItem]], Any]:
    world = draw(st.integers(1, 5))
    rng = random.Random(draw(st.integers(0, 10**6)))
    names = [f"k{i}" for i in range(rng.randint(1, 12))]
    plans = []
    for _ in range(world):
        plan = rng.sample(names, rng.randint(0, len(names)))
        if plan and rng.random() < 0.4:  # a key listed again somewhere in the plan
            plan.insert(rng.randint(0, len(plan)), rng.choice(plan))
        plans.append(_plan(plan))
    if world > 1 and rng.random() < 0.3:
        plans[1] = plans[0]  # a class of several ranks
    blocks = []
    for p in plans:
        ends = sorted({*rng.sample(range(1, len(p) + 1), min(len(p), 2)), len(p)}) if p else []
        blocks.append(block_digests(p, None, ends) if p else ([], []))
    return plans, blocks


@pytest.mark.spec("DEDUP-15", "DEDUP-9", "DEDUP-1")
@settings(max_examples=150)
@given(worlds_with_repeats())
def test_no_key_is_lost_whatever_the_plans_list(case: tuple[list[list[WriteItem]], Any]) -> None:
    """Either a problem names each rank listing a key twice, or every key held by any
    rank is written by exactly one of its holders; fast paths agree with the reference."""
    plans, blocks = case
    for b in (None, blocks):
        fast, problems = _both(plans, b)
        repeated = [r for r, p in enumerate(plans) if len({item_key(i) for i in p}) < len(p)]
        assert [int(m.split()[1].split("'")[0]) for m in problems] == repeated
        if not repeated:
            held = {item_key(i) for p in plans for i in p}
            written = [item_key(i) for p in fast.plans for i in p]
            assert sorted(written, key=repr) == sorted(held, key=repr)


@pytest.mark.spec("DEDUP-15")
def test_a_custom_planner_listing_a_chunk_twice_fails_the_save_before_writing(
    tmp_path: Any,
) -> None:
    import refdcp

    class Repeating(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            return dataclasses.replace(plan, items=[*plan.items, plan.items[0]])

    with pytest.raises(
        CheckpointError, match=r"PlanValidationError(.|\n)*rank 0's local plan lists 'w'"
    ):
        refdcp.save(
            {"w": torch.ones(2), "v": torch.ones(3)}, checkpoint_id=tmp_path, planner=Repeating()
        )
    assert not any(p.suffix == ".distcp" for p in tmp_path.iterdir())
    assert not (tmp_path / ".metadata").exists()
