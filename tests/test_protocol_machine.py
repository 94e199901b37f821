"""The protocol machines as data: purity, order violations, diagrams."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refdcp.errors import CheckpointError, Failure, FailureReport, ProtocolError
from refdcp.protocol import LOAD, SAVE, Event, Kind, On, State
from refdcp.protocol.machine import IDLE, TERMINAL
from refdcp.tools.diagrams import diagrams_path, render_all

TABLES = [SAVE, LOAD]
EVENTS = list(On)


def _event(on: On, rank: int) -> Event:
    if on is On.ERR:
        return Event(on, failure=Failure(rank, "x", ValueError("boom"), "tb"))
    if on is On.GOT_ERR:
        f = Failure(1, "y", KeyError("k"), "tb")
        return Event(on, error=FailureReport("y", {1: f}))
    return Event(on)


def _norm(result: tuple[State, object]) -> object:
    """Structural view: exceptions compare by identity, so compare what they say."""

    def err(e: FailureReport | None) -> object:
        return None if e is None else (e.step, tuple(e.rank_failures), e.committed)

    state, action = result
    return (
        (state.phase, state.rank, state.failure, err(state.error), state.committed),
        (action.kind, action.phase, action.step, action.recv, action.failure, err(action.error)),  # type: ignore[attr-defined]
    )


@pytest.mark.spec("PROTO-1")
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
@given(walk=st.lists(st.sampled_from(EVENTS), max_size=30), coordinator=st.booleans())
def test_transition_is_a_pure_function(table, walk, coordinator) -> None:  # type: ignore[no-untyped-def]
    """Same state and event give the same result, and the input state is never mutated."""
    state = State(IDLE, 0 if coordinator else 1, coordinator)
    state, _ = table.transition(state, Event(On.START))
    for on in walk:
        event = _event(on, state.rank)
        before = state
        try:
            a = table.transition(state, event)
        except ProtocolError:
            with pytest.raises(ProtocolError):
                table.transition(state, event)
            continue
        b = table.transition(state, event)
        assert _norm(a) == _norm(b)
        assert state == before
        state = a[0]
        if a[1].kind in TERMINAL:
            break


@pytest.mark.spec("PROTO-3")
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_disallowed_event_raises_protocol_error_naming_requirement(table) -> None:  # type: ignore[no-untyped-def]
    state, action = table.start(0, True)
    assert action.kind is Kind.LOCAL and action.step == "set_up"
    with pytest.raises(ProtocolError) as info:
        table.transition(state, Event(On.SENT))
    assert info.value.requirement == "PROTO-3"
    assert "set_up" in str(info.value) and "sent" in str(info.value)
    with pytest.raises(ProtocolError, match="PROTO-3"):
        table.transition(State("done", 0, True), Event(On.OK))


@pytest.mark.spec("PROTO-4")
def test_error_events_must_carry_their_failure() -> None:
    state, _ = SAVE.start(0, True)
    with pytest.raises(ProtocolError, match="PROTO-4"):
        SAVE.transition(state, Event(On.ERR))


@pytest.mark.spec("PROTO-4", "PROTO-5")
def test_failed_rank_skips_local_steps_and_sends_its_failure() -> None:
    state, _ = SAVE.start(1, False)
    failure = Failure(1, "set_up", ValueError("x"), "tb")
    state, action = SAVE.transition(state, Event(On.ERR, failure=failure))
    assert action.kind is Kind.GATHER and action.failure == failure
    state, action = SAVE.transition(state, Event(On.SENT))
    assert action.kind is Kind.SCATTER
    # The coordinator did not see the failure in time and sent a plan: the peer
    # still skips finish_plan and write, and carries the failure to the next gather.
    state, action = SAVE.transition(state, Event(On.GOT_OK))
    assert action.kind is Kind.GATHER and action.failure == failure


@pytest.mark.spec("SAVE-6", "SAVE-7")
def test_coordinator_commits_only_after_clean_results() -> None:
    state = State("gather_results", 0, True)
    _, action = SAVE.transition(state, Event(On.GOT_OK))
    assert action.kind is Kind.LOCAL and action.step == "commit"
    err = FailureReport("write", {2: Failure(2, "write", OSError("disk"), "tb")})
    state2, action = SAVE.transition(state, Event(On.GOT_ERR, error=err))
    assert action.kind is Kind.BROADCAST and action.error is not None
    assert not action.error.committed and 2 in action.error.rank_failures
    assert not state2.committed
    committed, action = SAVE.transition(State("commit", 0, True), Event(On.OK))
    assert committed.committed and action.kind is Kind.BROADCAST and action.error is None


@pytest.mark.spec("SAVE-9")
def test_failure_after_commit_is_reported_as_committed() -> None:
    state = State("broadcast_outcome", 0, True, committed=True)
    f = Failure(0, "broadcast_outcome", RuntimeError("late"), "tb")
    _, action = SAVE.transition(state, Event(On.ERR, failure=f))
    assert action.kind is Kind.BROADCAST and action.error is not None and action.error.committed
    assert "WAS committed" in str(CheckpointError.from_report(action.error))


@pytest.mark.spec("PROTO-8")
def test_diagrams_are_generated_from_the_tables() -> None:
    committed = diagrams_path().read_text(encoding="utf-8")
    assert committed == render_all(), "spec/diagrams.md is stale: run python -m refdcp.tools.diagrams"
    for table in TABLES:
        for row in table.rows:
            assert f"{row.phase if row.phase != IDLE else '[*]'} --> {row.next}" in committed
