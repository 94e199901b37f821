"""The reference dedup's decision records (DEDUP-10) and its greedy rule (DEDUP-2, DEDUP-3,
DEDUP-5), checked on the reference alone: exact bytes, the loads each reason names, one record
per replicated item, largest items first."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.local_plan import save_items
from refdcp.reference.dedup import chunk_nbytes, reference_dedup


@pytest.mark.spec("DEDUP-3", "DEDUP-10")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (2, 1, 4)])
def test_a_chunk_counts_its_elements_times_the_element_size(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    (item,) = save_items({"w": torch.zeros(shape, dtype=dtype)})
    n = torch.zeros(shape, dtype=dtype).numel() * torch.zeros((), dtype=dtype).element_size()
    assert chunk_nbytes(item) == n
    (obj,) = save_items({"o": [1, 2, 3]})
    assert chunk_nbytes(obj) == 1


@pytest.mark.spec("DEDUP-2", "DEDUP-10")
def test_reasons_name_the_holders_loads_in_bytes_so_far() -> None:
    plans = [save_items({"a": torch.zeros(4), "b": torch.zeros(2)}) for _ in range(2)]
    _, _, decisions = reference_dedup(plans)
    assert [(d.fqn, d.writer, d.nbytes) for d in decisions] == [("a", 0, 16), ("b", 1, 8)]
    assert decisions[0].reason.endswith("(0 B; r0=0, r1=0)")
    assert decisions[1].reason.endswith("(0 B; r0=16, r1=0)")


@pytest.mark.spec("DEDUP-2", "DEDUP-3", "DEDUP-5", "DEDUP-10")
def test_bytes_a_rank_writes_alone_count_against_it() -> None:
    """Rank 0 writes 40 bytes of its own, so the shared item goes to rank 1, whose load is 0."""
    plans = [
        save_items({"own0": torch.zeros(10), "shared": torch.zeros(4)}),
        save_items({"shared": torch.zeros(4)}),
    ]
    kept, problems, decisions = reference_dedup(plans)
    assert problems == []
    assert [[i.index.fqn for i in p] for p in kept] == [["own0"], ["shared"]]
    assert [(d.fqn, d.holders, d.writer) for d in decisions] == [("shared", [0, 1], 1)]
    assert decisions[0].reason.endswith("(0 B; r0=40, r1=0)")


@pytest.mark.spec("DEDUP-2", "DEDUP-10")
def test_one_record_per_replicated_item_largest_first() -> None:
    plans = [
        save_items({"small": torch.zeros(1), "big": torch.zeros(8), "mine": torch.zeros(2)}),
        save_items({"small": torch.zeros(1), "big": torch.zeros(8)}),
    ]
    kept, _, decisions = reference_dedup(plans, bytes_on_coordinator=False)
    # "mine" (8 B on rank 0) is no decision; "big" (32 B) is decided before "small" (4 B)
    assert [(d.fqn, d.nbytes, d.writer) for d in decisions] == [("big", 32, 1), ("small", 4, 0)]
    assert [sorted(i.index.fqn for i in p) for p in kept] == [["mine", "small"], ["big"]]


@pytest.mark.spec("DEDUP-2", "DEDUP-7", "DEDUP-10")
@pytest.mark.parametrize("coordinator", [0, 1, 2])
def test_objects_go_to_the_coordinator_when_it_holds_them_else_to_the_least_loaded(
    coordinator: int,
) -> None:
    plans = [
        save_items({"own": torch.zeros(3), "o": {"x": 1}, "t": torch.zeros(1)}),
        save_items({"o": {"x": 1}, "t": torch.zeros(1)}),
        save_items({}),
    ]
    _, _, decisions = reference_dedup(plans, coordinator_rank=coordinator)
    by = {d.fqn: d for d in decisions}
    if coordinator in (0, 1):  # a holder: the object stays on it
        assert by["o"].writer == coordinator and "coordinator" in by["o"].reason
    else:  # not a holder: least loaded (rank 0 wrote 12 bytes of its own)
        assert by["o"].writer == 1 and "fewest bytes" in by["o"].reason
    assert by["t"].writer == 1 and "fewest bytes" in by["t"].reason  # tensors never follow it
    _, _, plain = reference_dedup(plans, coordinator_rank=coordinator, bytes_on_coordinator=False)
    assert {d.fqn: d.writer for d in plain} == {"t": 1, "o": 1}
    _, _, low = reference_dedup(plans, coordinator_rank=coordinator, lowest_rank=True)
    assert {d.fqn: d.writer for d in low} == {"t": 0, "o": 0}
    assert all("lowest holding rank" in d.reason for d in low)


@pytest.mark.spec("DEDUP-4", "DEDUP-10")
def test_replicas_of_two_shapes_are_reported_with_their_ranks() -> None:
    plans = [
        save_items({"w": torch.zeros(4)}),
        save_items({"w": torch.zeros(4)}),
        save_items({"w": torch.zeros(5)}),
    ]
    _, problems, _ = reference_dedup(plans)
    assert len(problems) == 1
    assert "disagree in type, dtype or shape" in problems[0]
    assert "ranks [0, 1] hold" in problems[0] and "ranks [2] hold" in problems[0]


@pytest.mark.spec("DEDUP-4", "DEDUP-10")
def test_an_object_and_a_tensor_under_one_key_are_described_as_such() -> None:
    """A custom planner may list a tensor under an index with no offset, the key of an object."""
    (t,) = save_items({"k": torch.zeros(2, dtype=torch.int64)})
    t = dataclasses.replace(t, index=MetadataIndex("k"))
    plans = [save_items({"k": "text"}), [t]]
    _, problems, _ = reference_dedup(plans)
    assert problems == [
        "replicas of 'k' disagree in type, dtype or shape: ranks [0] hold a non-tensor object; "
        "ranks [1] hold a tensor of chunk shape (2,), dtype torch.int64, global shape (2,)"
    ]
    assert dedup_items(plans).problems == problems  # the fast dedup says the same (DEDUP-9)
