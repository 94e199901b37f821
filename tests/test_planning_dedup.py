"""Dedup of replicated items and global metadata validation (DEDUP-*, META-*)."""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refdcp.planning import DefaultSavePlanner, LocalShards, PlanValidationError
from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.local_plan import chunk_nbytes, item_key, save_items
from refdcp.planning.simulate import simulate_save


def global_plan(sds: list[dict[str, Any]], **opts: Any) -> Any:
    planners = [DefaultSavePlanner(**opts) for _ in sds]
    for r, (p, sd) in enumerate(zip(planners, sds)):
        p.set_up_planner(sd, None, r == 0)
    return planners[0].create_global_plan([p.create_local_plan() for p in planners])


@st.composite
def replicated_world(draw: st.DrawFn) -> tuple[int, list[list[Any]]]:
    world = draw(st.integers(1, 8))
    n_items = draw(st.integers(0, 30))
    sizes = draw(st.lists(st.integers(0, 50), min_size=n_items, max_size=n_items))
    rng = random.Random(draw(st.integers(0, 10**6)))
    every = draw(st.booleans())
    tensors = {f"t{i}": torch.zeros(s) for i, s in enumerate(sizes)}
    per_rank: list[dict[str, Any]] = [{} for _ in range(world)]
    for name, t in tensors.items():
        holders = range(world) if every else rng.sample(range(world), rng.randint(1, world))
        for r in holders:
            per_rank[r][name] = t
    for r in range(world):
        per_rank[r][f"own{r}"] = torch.zeros(rng.randint(0, 40))
    return world, [save_items(sd) for sd in per_rank]


@pytest.mark.spec("DEDUP-1", "DEDUP-2", "DEDUP-3", "DEDUP-5", "DEDUP-8")
@given(replicated_world())
def test_each_item_written_once_and_balanced(case: tuple[int, list[list[Any]]]) -> None:
    world, plans = case
    res = dedup_items(plans)
    assert res.problems == []
    written = Counter(item_key(i) for p in res.plans for i in p)
    held = {item_key(i) for p in plans for i in p}
    assert set(written) == held and all(c == 1 for c in written.values())
    for r, p in enumerate(res.plans):  # every kept item was held by that rank
        assert {item_key(i) for i in p} <= {item_key(i) for i in plans[r]}
        assert res.rank_bytes()[r] == sum(chunk_nbytes(i) for i in p)
    holders = Counter(item_key(i) for p in plans for i in p)
    for r, p in enumerate(plans):  # DEDUP-5: single-holder items stay
        for i in p:
            if holders[item_key(i)] == 1:
                assert item_key(i) in {item_key(j) for j in res.plans[r]}
    if all(holders[item_key(i)] in (1, world) for p in plans for i in p):
        rep = [chunk_nbytes(i) for i in plans[0] if holders[item_key(i)] == world > 1]
        unique = [sum(chunk_nbytes(i) for i in p if holders[item_key(i)] == 1) for p in plans]
        if rep:
            bound = max(max(unique), (sum(rep) + sum(unique)) / world + max(rep))
            assert max(res.rank_bytes()) <= bound
    # DEDUP-8: the digests only group identical plans; they never change the result
    slow = dedup_items(plans, digests=[f"rank{r}" for r in range(world)])
    assert [[item_key(i) for i in p] for p in slow.plans] == [
        [item_key(i) for i in p] for p in res.plans
    ]


@pytest.mark.spec("DEDUP-2", "DEDUP-3")
def test_largest_first_uses_chunk_bytes_not_global_size() -> None:
    # 4 ranks each hold every chunk of a (400,) tensor split in 4: torch would weigh
    # each chunk as the whole tensor; by chunk bytes the 4 chunks spread over 4 ranks.
    chunks = [((i * 100,), torch.zeros(100)) for i in range(4)]
    sds = [{"x": LocalShards((400,), chunks)} for _ in range(4)]
    plans, _ = global_plan(sds)
    assert [len(p.items) for p in plans] == [1, 1, 1, 1]
    plans_low, _ = global_plan(sds, dedup_save_to_lowest_rank=True)
    assert [len(p.items) for p in plans_low] == [4, 0, 0, 0]


@pytest.mark.spec("DEDUP-7")
def test_objects_stay_on_the_coordinator() -> None:
    sds = [{f"o{i}": i for i in range(6)} | {"t": torch.zeros(8)} for _ in range(3)]
    plans, _ = global_plan(sds)
    assert {i.index.fqn for i in plans[0].items} >= {f"o{i}" for i in range(6)}
    spread, _ = global_plan(sds, bytes_on_coordinator=False)
    obj_ranks = {r for r, p in enumerate(spread) for i in p.items if i.index.fqn[0] == "o"}
    assert len(obj_ranks) > 1


@pytest.mark.spec("DEDUP-6", "DEDUP-13")
def test_differing_replica_values_name_key_and_ranks() -> None:
    sds = [{"w": torch.ones(4), "step": 1}, {"w": torch.ones(4), "step": 1}]
    sds.append({"w": torch.full((4,), 2.0), "step": 2})
    with pytest.raises(PlanValidationError) as err:
        global_plan(sds, check_replicas=True)
    msg = str(err.value)
    assert "'w'" in msg and "ranks [0, 1]" in msg and "ranks [2]" in msg
    assert "'step'" in msg and "differ in value" in msg
    # the default checks too (DEDUP-13)
    with pytest.raises(PlanValidationError, match="differ in value"):
        global_plan(sds)
    # the opt-out gives torch's behaviour: one copy is kept silently
    plans, _ = global_plan(sds, check_replicas=False)
    assert sum(len(p.items) for p in plans) == 2


@pytest.mark.spec("DEDUP-4", "META-5")
def test_replicas_disagreeing_in_dtype_or_shape() -> None:
    sds = [
        {"a": torch.zeros(3), "b": torch.zeros(3), "c": 1},
        {"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros(4), "c": torch.zeros(1)},
    ]
    with pytest.raises(PlanValidationError) as err:
        global_plan(sds)
    problems = err.value.problems
    assert len(problems) == 3  # all three reported at once
    text = "\n".join(problems)
    assert "'a'" in text and "torch.float16" in text and "ranks [1]" in text
    assert "'b'" in text and "'c'" in text and "bytes on ranks [0]" in text


@pytest.mark.spec("META-1")
def test_metadata_records_every_chunk_once() -> None:
    sds = [
        {"x": LocalShards((5, 2), [((0, 0), torch.zeros(3, 2))]), "s": "obj"},
        {"x": LocalShards((5, 2), [((3, 0), torch.zeros(2, 2))]), "s": "obj"},
        {"x": LocalShards((5, 2), [], dtype=torch.float32), "s": "obj"},
    ]
    _, md = global_plan(sds)
    x = md.state_dict_metadata["x"]
    assert x.size == torch.Size([5, 2]) and x.properties.dtype == torch.float32
    assert sorted(tuple(c.offsets) for c in x.chunks) == [(0, 0), (3, 0)]
    assert type(md.state_dict_metadata["s"]).__name__ == "BytesStorageMetadata"
    # a sharded value with no chunk anywhere is still recorded when it is empty
    _, md0 = global_plan([{"z": LocalShards((0, 4), [], dtype=torch.int8)}] * 2)
    assert md0.state_dict_metadata["z"].chunks == []


@pytest.mark.spec("META-2", "META-3", "META-5")
def test_bounds_overlap_and_coverage_all_reported() -> None:
    sds = [
        {
            "gap": LocalShards((4,), [((0,), torch.zeros(2))]),
            "over": LocalShards((4, 4), [((0, 0), torch.zeros(3, 4))]),
        },
        {
            "gap": LocalShards((4,), [], dtype=torch.float32),
            "over": LocalShards((4, 4), [((2, 0), torch.zeros(2, 4))]),
        },
    ]
    with pytest.raises(PlanValidationError) as err:
        global_plan(sds)
    text = "\n".join(err.value.problems)
    assert "'gap'" in text and "cover 2 of 4" in text
    assert "'over'" in text and "overlaps" in text and "rank 0" in text and "rank 1" in text
    # world size 1 is checked too (torch skips coverage there)
    with pytest.raises(PlanValidationError, match="cover 2 of 4"):
        global_plan([{"gap": LocalShards((4,), [((0,), torch.zeros(2))])}])


@pytest.mark.spec("META-2")
def test_out_of_bounds_chunk_from_a_custom_item() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from refdcp.planning.metadata.build import build_state_dict_metadata

    bad = WriteItem(
        index=MetadataIndex("x", torch.Size([3])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([3]), torch.Size([2])),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([4]),
        ),
    )
    _, problems = build_state_dict_metadata([[bad]])
    assert any("outside the global shape" in p and "rank 0" in p for p in problems)


@pytest.mark.spec("META-4")
def test_ranks_disagree_on_global_shape_or_kind() -> None:
    sds = [
        {"x": LocalShards((4,), [((0,), torch.zeros(2))]), "k": torch.zeros(1)},
        {"x": LocalShards((5,), [((2,), torch.zeros(3))]), "k": torch.zeros(1)},
    ]
    with pytest.raises(PlanValidationError, match=r"'x'.*disagree on dtype or global shape"):
        global_plan(sds)
    ckpt = simulate_save([{"k": torch.zeros(2)}, {"k": torch.zeros(2)}], DefaultSavePlanner)
    assert len(ckpt.data) == 1


@pytest.mark.spec("DEDUP-6")
def test_object_checksum_does_not_depend_on_the_hash_seed() -> None:
    """Ranks on other hosts have other hash seeds: equal sets and dicts must still agree."""
    import subprocess
    import sys

    code = (
        "from refdcp.planning.local_plan import object_checksum;"
        "print(object_checksum({'cfg': {'layers', 'heads', 'dim'}, 'b': 1, 'a': [frozenset('xyz')]}))"
    )
    seen = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout.strip())
    assert len(seen) == 1
    from refdcp.planning.local_plan import object_checksum

    assert object_checksum({"b": 1, "a": 2}) == object_checksum({"a": 2, "b": 1})
    assert object_checksum({1, 2}) != object_checksum({1, 3})


@pytest.mark.spec("META-4")
def test_rank_without_chunks_must_agree_on_dtype_and_shape() -> None:
    from refdcp.planning import LocalShards
    from refdcp.planning.metadata.build import PlanValidationError
    from refdcp.planning.simulate import simulate_save

    states = [
        {"x": LocalShards((4,), [((0,), torch.ones(4))])},
        {"x": LocalShards((9, 9), [], dtype=torch.int64)},  # holds nothing, claims another tensor
    ]
    with pytest.raises(PlanValidationError, match=r"'x': ranks disagree .*rank 1 say dtype torch.int64"):
        simulate_save(states, DefaultSavePlanner)
    agreeing = [states[0], {"x": LocalShards((4,), [], dtype=torch.float32)}]
    simulate_save(agreeing, DefaultSavePlanner)
