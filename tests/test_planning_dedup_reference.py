"""The fast dedup equals its reference rule on any input (DEDUP-9, DEDUP-10)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.local_plan import chunk_nbytes, item_key, save_items
from refdcp.reference.dedup import reference_dedup
from tests._dedup_cases import checksums_and_options

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, Any]:
    """Ranks holding tensors and objects, some replicated, some disagreeing, some checksummed."""
    world = draw(st.integers(1, 7))
    rng = random.Random(draw(st.integers(0, 10**6)))
    per_rank: list[dict[str, Any]] = [{} for _ in range(world)]
    for i in range(draw(st.integers(0, 25))):
        holders = rng.sample(range(world), rng.randint(1, world))
        kind = rng.choice(["tensor", "tensor", "object"])
        size, dtype = rng.randint(0, 40), rng.choice(DTYPES)
        for r in holders:
            if kind == "object":
                value: Any = rng.choice([7, "s", [1, 2], None])
            else:
                odd = rng.random() < 0.1  # a replica that disagrees in dtype or shape
                value = torch.zeros(
                    size + (odd and rng.random() < 0.5), dtype=rng.choice(DTYPES) if odd else dtype
                )
            per_rank[r][f"k{i}"] = value
    for r in range(world):
        if rng.random() < 0.7:
            per_rank[r][f"own{r}"] = torch.zeros(rng.randint(0, 30))
    plans = [save_items(sd) for sd in per_rank]
    return checksums_and_options(draw, rng, plans, missing=0.2, values=[1, 1, 1, 2])


@pytest.mark.spec("DEDUP-9")
@settings(max_examples=300)  # cheap examples; rare shapes need many
@given(worlds())
def test_fast_dedup_equals_the_reference_rule(case: dict[str, Any]) -> None:
    fast = dedup_items(**case)
    kept, problems, decisions = reference_dedup(**case)
    assert fast.plans == kept
    assert fast.problems == problems
    writer = {item_key(i): r for r, plan in enumerate(fast.plans) for i in plan}
    for d in decisions:
        key = next(item_key(i) for p in case["plans"] for i in p if i.index.fqn == d.fqn)
        assert writer[key] == d.writer and d.writer in d.holders and len(d.holders) > 1


@pytest.mark.spec("DEDUP-10")
def test_a_non_tensor_item_counts_one_byte_in_the_records_as_in_the_planner() -> None:
    plans = [save_items({"step": 3, "w": torch.zeros(4)}) for _ in range(2)]
    _, _, decisions = reference_dedup(plans)
    step = next(d for d in decisions if d.fqn == "step")
    assert step.nbytes == 1 == chunk_nbytes(next(i for i in plans[0] if i.index.fqn == "step"))
    assert step.writer == 0 and "coordinator" in step.reason
    w = next(d for d in decisions if d.fqn == "w")
    assert w.nbytes == 16 and "fewest bytes" in w.reason


@pytest.mark.spec("DEDUP-9", "DEDUP-10")
def test_a_non_tensor_item_weighs_one_byte_when_it_decides_a_tie() -> None:
    """Two equal ranks: the object goes to rank 0, so the empty tensor after it goes to rank 1."""
    plans = [save_items({"a": "obj", "z": torch.zeros(0)}) for _ in range(2)]
    kept, _, decisions = reference_dedup(plans, bytes_on_coordinator=False)
    assert [[i.index.fqn for i in p] for p in kept] == [["a"], ["z"]]
    assert dedup_items(plans, bytes_on_coordinator=False).plans == kept
    assert [(d.fqn, d.nbytes, d.writer) for d in decisions] == [("a", 1, 0), ("z", 0, 1)]


@pytest.mark.spec("TRACE-7")
def test_trace_shows_the_reference_records() -> None:
    from refdcp.tools.trace import run_trace

    res = run_trace(4, 2, "rows")
    _, _, decisions = reference_dedup([list(p.items) for p in res.local_plans])
    assert res.decisions == decisions
    assert all("(!)" not in d.reason for d in res.decisions)
    assert next(d for d in res.decisions if d.fqn == "step").nbytes == 1
