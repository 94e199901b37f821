"""The staging buffer pool against a model of STAGE-3..STAGE-5 (random lease sequences)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refdcp.errors import ProtocolError
from refdcp.staging.buffer_pool import BufferPool, Lease, StagingTimeoutError
from refdcp.staging.machine import State
from refdcp.staging.tree import layout_of, nbytes_of

LAYOUTS = [
    layout_of({"a": torch.zeros(4), "b": torch.zeros(2, 3, dtype=torch.float64)}),
    layout_of({"a": torch.zeros(5, dtype=torch.int8)}),
    layout_of({"w": torch.zeros(3, 3, dtype=torch.bfloat16), "n": 1, "v": torch.zeros(0)}),
]


@pytest.mark.spec("STAGE-5")
def test_layout_bytes_are_element_count_times_item_size() -> None:
    assert [nbytes_of(lay) for lay in LAYOUTS] == [4 * 4 + 6 * 8, 5, 9 * 2]
    t = torch.zeros(6)
    assert nbytes_of(layout_of({"x": t, "same": t})) == 24  # a repeated tensor is staged once


@pytest.mark.spec("STAGE-3", "STAGE-5", "STAGE-11")
@given(
    max_sets=st.integers(1, 3),
    budget=st.sampled_from([None, 64, 100, 200]),
    ops=st.lists(
        st.tuples(st.sampled_from(["acquire", "release"]), st.integers(0, 2)), max_size=25
    ),
)
def test_pool_follows_the_budget_and_reuses_free_sets(
    max_sets: int, budget: int | None, ops: list[tuple[str, int]]
) -> None:
    pool = BufferPool(max_sets=max_sets, max_bytes=budget, wait_timeout=0.0)
    leases: list[Lease] = []
    for op, i in ops:
        if op == "release":
            if leases:
                lease = leases.pop(i % len(leases))
                pool.copy_done(lease)
                lease.release()
            continue
        layout = LAYOUTS[i]
        need = nbytes_of(layout)
        leased_bytes = sum(nbytes_of(le.bset.layout) for le in leases)
        free_match = any(
            s.layout == layout and s.state not in (State.STAGING, State.STAGED) for s in pool._sets
        )
        before = pool.allocations
        fits = len(leases) + 1 <= max_sets and (budget is None or leased_bytes + need <= budget)
        if budget is not None and need > budget:
            with pytest.raises(ValueError):
                pool.acquire(layout)
            continue
        if not free_match and not fits:
            with pytest.raises(StagingTimeoutError):
                pool.acquire(layout)
            continue
        lease = pool.acquire(layout)  # a free matching set, or room after evicting free sets
        assert all(lease.bset is not other.bset for other in leases)  # STAGE-3
        assert pool.allocations == before + (0 if free_match else 1)  # STAGE-11: reuse
        leases.append(lease)
        assert len(pool.states()) <= max_sets
        assert budget is None or pool.held_bytes <= budget
        assert pool.held_bytes == sum(nbytes_of(s.layout) for s in pool._sets)
    for lease in leases:
        pool.copy_done(lease)
        lease.release()
    pool.close()


@pytest.mark.spec("STAGE-4")
def test_a_refused_close_frees_nothing() -> None:
    pool = BufferPool(max_sets=2)
    idle = pool.acquire(LAYOUTS[0])
    pool.copy_done(idle)
    idle.release()
    busy = pool.acquire(LAYOUTS[1])
    pool.copy_done(busy)
    with pytest.raises(ProtocolError):
        pool.close()
    assert State.CLOSED not in pool.states() and len(pool.states()) == 2
    busy.release()
    pool.close()
    assert pool.states() == []


@pytest.mark.spec("STAGE-5", "STAGE-1")
def test_evicted_and_closed_sets_drop_their_buffers() -> None:
    pool = BufferPool(max_sets=1)
    first = pool.acquire(LAYOUTS[0])
    pool.copy_done(first)
    first.release()
    old = first.bset
    second = pool.acquire(LAYOUTS[1])  # no room: the free set of the other layout is evicted
    assert old.state is State.CLOSED and old.buffers == []
    pool.copy_done(second)
    second.release()
    pool.close()
    assert second.bset.state is State.CLOSED and second.bset.buffers == []
