"""The stager state machine and buffer pool leases (spec/staging.md STAGE-1..STAGE-5)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refdcp.errors import ProtocolError
from refdcp.staging.buffer_pool import BufferPool, StagingTimeoutError
from refdcp.staging.machine import LEASED, TRANSITIONS, Action, Event, State, step
from refdcp.staging.tree import layout_of

LAYOUT = layout_of({"a": torch.zeros(4), "b": torch.zeros(2, 3)})
OTHER = layout_of({"a": torch.zeros(5)})


@pytest.mark.spec("STAGE-1")
def test_happy_path_and_reuse() -> None:
    s = State.IDLE
    trace = []
    for ev in [Event.STAGE, Event.COPY_DONE, Event.RELEASE, Event.STAGE, Event.COPY_DONE]:
        s, act = step(s, ev)
        trace.append((s, act))
    assert trace == [
        (State.STAGING, Action.COPY),
        (State.STAGED, Action.SIGNAL_STAGED),
        (State.RELEASED, Action.RETURN_TO_POOL),
        (State.STAGING, Action.COPY),
        (State.STAGED, Action.SIGNAL_STAGED),
    ]
    assert step(State.STAGING, Event.COPY_FAILED) == (State.RELEASED, Action.RETURN_TO_POOL)
    assert step(State.RELEASED, Event.CLOSE) == (State.CLOSED, Action.FREE)


@pytest.mark.spec("STAGE-1", "STAGE-2", "STAGE-3", "STAGE-4")
@given(st.sampled_from(list(State)), st.sampled_from(list(Event)))
def test_every_pair_is_in_table_or_raises(state: State, event: Event) -> None:
    if (state, event) in TRANSITIONS:
        nxt, act = step(state, event)
        assert (nxt, act) == TRANSITIONS[(state, event)]
        return
    with pytest.raises(ProtocolError) as info:
        step(state, event)
    if event is Event.STAGE and state in LEASED:
        assert info.value.requirement == "STAGE-3"
    elif event is Event.CLOSE and state in LEASED:
        assert info.value.requirement == "STAGE-4"
    else:
        assert info.value.requirement == "STAGE-2"


@pytest.mark.spec("STAGE-3")
def test_leased_set_is_never_handed_out_twice() -> None:
    pool = BufferPool(max_sets=2, wait_timeout=0.05)
    a = pool.acquire(LAYOUT)
    b = pool.acquire(LAYOUT)
    assert a.bset is not b.bset
    ptrs_a = {t.data_ptr() for t in a.buffers if t is not None}
    ptrs_b = {t.data_ptr() for t in b.buffers if t is not None}
    assert not ptrs_a & ptrs_b
    with pytest.raises(StagingTimeoutError):
        pool.acquire(LAYOUT)
    with pytest.raises(ProtocolError) as info:
        pool._apply(a.bset, Event.STAGE)
    assert info.value.requirement == "STAGE-3"


@pytest.mark.spec("STAGE-4")
def test_close_refuses_while_leased() -> None:
    pool = BufferPool()
    lease = pool.acquire(LAYOUT)
    pool.copy_done(lease)
    with pytest.raises(ProtocolError) as info:
        pool.close()
    assert info.value.requirement == "STAGE-4"
    assert lease.buffers[0] is not None and lease.buffers[0].numel() == 4  # not freed
    lease.release()
    pool.close()
    assert pool.states() == []


@pytest.mark.spec("STAGE-5")
def test_waits_for_release_when_full() -> None:
    pool = BufferPool(max_sets=1, wait_timeout=10.0)
    lease = pool.acquire(LAYOUT)
    pool.copy_done(lease)
    got: list[object] = []

    def second() -> None:
        got.append(pool.acquire(LAYOUT))

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.1)
    assert not got  # still waiting: the only set is leased
    lease.release()
    t.join(5.0)
    assert len(got) == 1 and pool.allocations == 1


@pytest.mark.spec("STAGE-5")
def test_budget_allocation_eviction_and_timeout() -> None:
    need = 4 * 4 + 6 * 4
    pool = BufferPool(max_sets=4, max_bytes=2 * need, wait_timeout=0.05)
    a = pool.acquire(LAYOUT)
    pool.acquire(LAYOUT)
    assert pool.allocations == 2
    with pytest.raises(StagingTimeoutError):
        pool.acquire(LAYOUT)  # a third set would exceed max_bytes
    with pytest.raises(ValueError):
        pool.acquire(layout_of({"x": torch.zeros(100)}))  # larger than the budget itself
    pool.copy_done(a)
    a.release()
    c = pool.acquire(OTHER)  # evicts the free set of the other layout
    assert pool.allocations == 3 and len(pool.states()) == 2
    assert c.bset.layout == OTHER


@pytest.mark.spec("STAGE-21")
def test_staging_spec_table_is_generated_from_the_transitions() -> None:
    from refdcp.tools.diagrams import render_staging_spec, staging_spec_path

    text = staging_spec_path().read_text(encoding="utf-8")
    assert text == render_staging_spec(text), "spec/staging.md is stale: run python -m refdcp.tools.diagrams"
    for (state, event), (nxt, action) in TRANSITIONS.items():
        assert f"| {state.value} | {event.value} | {nxt.value} | {action.value} |" in text
