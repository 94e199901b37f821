"""Fast paths of the global save plan: block digests (PLAN-15, DEDUP-14) and independent
classes (DEDUP-12) give exactly the reference rule's result (DEDUP-9)."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import refdcp.planning.dedup.blocks as blocks_module
import refdcp.planning.dedup.classes as dedup_module
import refdcp.planning.local_plan as local_plan
from refdcp.planning import DefaultSavePlanner, PlanValidationError
from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.planning.local_plan import (
    block_digests,
    item_key,
    plan_and_block_digests,
    plan_digest,
    save_items,
)
from refdcp.reference.dedup import reference_dedup
from tests._dedup_cases import checksums_and_options

DTYPES = [torch.float32, torch.int64]


class _Calls:
    """Counts the calls of a module function while still running it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.n = 0
        orig = getattr(module, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            self.n += 1
            return orig(*a, **k)

        monkeypatch.setattr(module, name, wrapped)


@st.composite
def near_equal_worlds(draw: st.DrawFn) -> dict[str, Any]:
    """Ranks holding one common state dict, each with a few differences: an own item, a
    removed item, a replica of another dtype or shape, an object, a differing checksum."""
    world = draw(st.integers(2, 7))
    rng = random.Random(draw(st.integers(0, 10**6)))
    base = {f"m{i}.w": torch.zeros(rng.randint(0, 24)) for i in range(rng.randint(0, 60))}
    sds: list[dict[str, Any]] = []
    for r in range(world):
        sd: dict[str, Any] = dict(base)
        if rng.random() < 0.6:
            sd[f"own{r}"] = torch.zeros(rng.randint(0, 30))
        if base and rng.random() < 0.2:  # a replica that disagrees in dtype or shape
            sd[rng.choice(list(base))] = torch.zeros(3, dtype=rng.choice(DTYPES))
        if base and rng.random() < 0.2:
            sd.pop(rng.choice(list(base)))
        if rng.random() < 0.3:
            sd["step"] = rng.choice([1, "x"])
        sds.append(sd)
    plans = [save_items(sd) for sd in sds]
    return {
        **checksums_and_options(draw, rng, plans, missing=0.1, values=[1] * 12 + [2]),
        "cut": draw(st.sampled_from(["content", "random", "none"])),
        "seed": rng.random(),
    }


def _random_blocks(plan: list[WriteItem], sums: Any, rng: random.Random) -> Any:
    """Any cut of the plan, each block digested honestly (as block_digests does)."""
    if not plan:
        return [], []
    picked = rng.sample(range(1, len(plan) + 1), rng.randint(1, len(plan)))
    ends = sorted({*picked, len(plan)})
    return block_digests(plan, sums, ends)


@pytest.mark.spec("DEDUP-14", "DEDUP-9", "DEDUP-8")
@settings(max_examples=200)
@given(near_equal_worlds())
def test_blocks_never_change_the_result(case: dict[str, Any]) -> None:
    """However plans are cut into blocks, dedup gives the reference's plans and problems."""
    plans, sums = case["plans"], case["checksums"]
    opts = {k: case[k] for k in ("coordinator_rank", "bytes_on_coordinator", "lowest_rank")}
    per_sums = sums or [None] * len(plans)
    rng = random.Random(case["seed"])
    if case["cut"] == "content":
        old = local_plan.BLOCK_SPACING
        local_plan.BLOCK_SPACING = rng.choice([1, 2, 4, 8])  # small blocks: many cuts
        try:
            blocks: list[Any] = [block_digests(p, s) for p, s in zip(plans, per_sums)]
        finally:
            local_plan.BLOCK_SPACING = old
    elif case["cut"] == "random":
        blocks = [_random_blocks(p, s, rng) for p, s in zip(plans, per_sums)]
    else:
        blocks = [None] * len(plans)
    fast = dedup_items(plans, checksums=sums, blocks=blocks, **opts)
    kept, problems, _ = reference_dedup(plans, checksums=sums, **opts)
    assert fast.plans == kept
    assert fast.problems == problems
    without = dedup_items(plans, checksums=sums, **opts)
    assert without.plans == fast.plans and without.problems == fast.problems


def _mixed(world: int, n: int) -> list[list[WriteItem]]:
    base = {f"layer{i}.w": torch.zeros(1 + i % 7) for i in range(n)}
    return [save_items({**base, f"own{r}": torch.zeros(2)}) for r in range(world)]


@pytest.mark.spec("DEDUP-14")
def test_common_blocks_of_differing_plans_are_handled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _mixed(16, 300)
    assert len({plan_digest(p) for p in plans}) == 16  # no two plans equal
    calls = _Calls(monkeypatch, blocks_module, "dedup_by_blocks")
    blocks = [block_digests(p) for p in plans]
    assert len(blocks[0][0]) > 1  # cut into several blocks
    fast = dedup_items(plans, blocks=blocks)
    assert calls.n == 1
    kept, problems, _ = reference_dedup(plans)
    assert fast.plans == kept and problems == fast.problems == []


@pytest.mark.spec("DEDUP-14", "DEDUP-6", "DEDUP-13")
def test_a_rank_whose_shared_block_differs_in_one_value_is_named() -> None:
    """Through the planner: 6 ranks, the same 600 tensors plus their own; rank 4 holds
    another value of one of them, inside a block the others share."""
    world = 6
    sds = [
        {
            **{f"layer{i}.w": torch.full((3,), float(i)) for i in range(600)},
            f"own{r}": torch.ones(1),
        }
        for r in range(world)
    ]
    sds[4]["layer377.w"] = torch.full((3,), -1.0)
    planners = [DefaultSavePlanner() for _ in range(world)]
    for r, p in enumerate(planners):
        p.set_up_planner(sds[r], None, r == 0)
    local = [p.create_local_plan() for p in planners]
    assert all(len(lp.planner_data[RESERVED_KEY]["blocks"][0]) > 1 for lp in local[1:])
    with pytest.raises(PlanValidationError) as err:
        planners[0].create_global_plan(local)
    msg = str(err.value)
    assert "'layer377.w'" in msg and "differ in value" in msg and "ranks [4]" in msg


@pytest.mark.spec("DEDUP-14", "META-8")
def test_metadata_pickles_to_the_same_bytes_with_or_without_blocks() -> None:
    world = 5
    sds = [
        {
            **{f"p{i}": torch.zeros(1 + i % 5) for i in range(150)},
            "step": 3,
            f"own{r}": torch.ones(r),
        }
        for r in range(world)
    ]

    def run(strip: bool) -> tuple[bytes, list[list[Any]]]:
        planners = [DefaultSavePlanner() for _ in range(world)]
        for r, p in enumerate(planners):
            p.set_up_planner(sds[r], None, r == 0)
        local = [p.create_local_plan() for p in planners]
        if strip:
            for lp in local:
                lp.planner_data[RESERVED_KEY]["blocks"] = None
        plans, md = planners[0].create_global_plan(local)
        return pickle.dumps(md), [[item_key(i) for i in p.items] for p in plans]

    assert run(False) == run(True)


@pytest.mark.spec("PLAN-15")
def test_block_digests_follow_content_not_position() -> None:
    sd = {f"layer{i}.w": torch.zeros(4) for i in range(500)}
    plain = save_items(sd)
    shifted = save_items({"first": torch.zeros(1), **sd, "last": torch.zeros(1)})
    ends, digests = block_digests(plain)
    _, digests2 = block_digests(shifted)
    assert ends[-1] == len(plain) and len(ends) == len(digests) > 2
    # every block but the first and the last (which take in the added items) comes back
    assert len(digests) > 3 and set(digests[1:-1]) <= set(digests2)
    # a different shape or a different checksum changes exactly one block's digest
    other = save_items({**sd, "layer250.w": torch.zeros(5)})
    assert sum(a != b for a, b in zip(digests, block_digests(other)[1])) == 1
    sums = {item_key(i): 1 for i in plain}
    changed = {**sums, item_key(plain[123]): 2}
    a, b = block_digests(plain, sums)[1], block_digests(plain, changed)[1]
    assert sum(x != y for x, y in zip(a, b)) == 1
    assert block_digests([]) == ([], [])
    assert plan_and_block_digests(plain, sums) == (
        plan_digest(plain, sums),
        block_digests(plain, sums),
    )
    assert plan_and_block_digests([]) == (plan_digest([]), ([], []))


@pytest.mark.spec("PLAN-15")
def test_block_digests_do_not_depend_on_the_process() -> None:
    code = (
        "import torch;from refdcp.planning.local_plan import block_digests, save_items;"
        "p=save_items({f'k{i}': torch.zeros(i % 9) for i in range(300)});"
        "print(block_digests(p, {(i.index.fqn, i.index.offset): 7 for i in p}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    p = save_items({f"k{i}": torch.zeros(i % 9) for i in range(300)})
    assert out.stdout.strip() == repr(block_digests(p, {item_key(i): 7 for i in p}))


def _hsdp(replicas: int, sizes: list[list[tuple[int, torch.dtype]]]) -> list[list[WriteItem]]:
    """Rank ``rep * shards + s`` holds shard ``s``: one (rows, 2) row-chunk per tensor."""
    shards = len(sizes)
    per_shard = []
    for s, row in enumerate(sizes):
        items = []
        for j, (n, dtype) in enumerate(row):
            off = torch.Size((s * 8, 0))
            items.append(
                WriteItem(
                    index=MetadataIndex(f"t{j}", off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size((n, 2))),
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size((8 * shards, 2)),
                    ),
                )
            )
        per_shard.append(items)
    return [list(per_shard[r % shards]) for r in range(replicas * shards)]


@pytest.mark.spec("DEDUP-12", "DEDUP-9")
@settings(max_examples=150)
@given(
    st.integers(2, 5),
    st.lists(
        st.lists(st.tuples(st.integers(0, 8), st.sampled_from(DTYPES)), max_size=8),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
    st.booleans(),
)
def test_independent_classes_equal_the_reference(
    replicas: int, sizes: list[list[tuple[int, torch.dtype]]], lowest: bool, same: bool
) -> None:
    if same:  # every shard with the same sizes: one pattern for all classes
        sizes = [sizes[0]] * len(sizes)
    plans = _hsdp(replicas, sizes)
    fast = dedup_items(plans, lowest_rank=lowest)
    kept, problems, _ = reference_dedup(plans, lowest_rank=lowest)
    assert fast.plans == kept and fast.problems == problems == []
    # each rank its own class: the general greedy, same result
    slow = dedup_items(plans, digests=[f"r{r}" for r in range(len(plans))], lowest_rank=lowest)
    assert slow.plans == fast.plans


@pytest.mark.spec("DEDUP-12")
def test_independent_classes_take_the_pattern_path(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _hsdp(4, [[(2, torch.float32), (5, torch.float32), (1, torch.int64)]] * 6)
    calls = _Calls(monkeypatch, dedup_module, "_class_pattern")
    fast = dedup_items(plans)
    assert calls.n == 1  # six shards, one size pattern: computed once
    assert fast.plans == reference_dedup(plans)[0]
