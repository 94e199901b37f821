"""Protocol rows: well-formed rows only, honest action names, a fault in ``failed`` stays failed
(PROTO-1, PROTO-7, PROTO-12, TRACE-10).

Checked for every row of both tables, through ``Table.transition`` (the pure
function drivers call), not through the rows' own fields alone.
"""

from __future__ import annotations

import pytest

import refdcp.protocol.load as load_protocol
import refdcp.protocol.save as save_protocol
from refdcp.errors import Failure
from refdcp.protocol.machine import COLLECTIVES, Event, Kind, On, Role, Row, State, Table
from refdcp.protocol.names import Phase, Slot, Step

# by name, looked up when the test runs: a table rebuilt after the test module was
# imported (as the mutation run does) is the one checked
TABLES = pytest.mark.parametrize("name", ["save", "load"])


def _table(name: str) -> Table:
    return save_protocol.SAVE if name == "save" else load_protocol.LOAD


def _event(on: On) -> Event:
    if on is On.ERR:
        fail = Failure(rank=0, step="x", exception=RuntimeError("x"), traceback_text="")
        return Event(on, failure=fail)
    if on is On.GOT_ERR:
        from refdcp.errors import CheckpointError

        fail = Failure(rank=1, step="x", exception=RuntimeError("x"), traceback_text="")
        return Event(on, error=CheckpointError("x", {1: fail}))
    return Event(on)


@pytest.mark.spec("TRACE-10", "PROTO-12")
@TABLES
def test_each_action_is_named_by_its_step_else_its_slot_else_its_phase(name: str) -> None:
    table = _table(name)
    """What a trace shows for an action: a local step by its name, a collective by what it
    sends, a return by its slot (or its phase when it returns nothing), a raise by its phase."""
    for row in table.rows:
        coordinator = row.role is not Role.PEER
        state = State(row.phase, 0, coordinator)
        _, action = table.transition(state, _event(row.on))
        if row.kind is Kind.LOCAL:
            assert action.name == str(row.step)
        elif row.kind in COLLECTIVES:
            assert action.name == str(row.send) and action.name != str(row.next), row
        elif row.kind is Kind.RETURN and row.send is not None:
            assert action.name == str(row.send)
        else:
            assert action.name == str(row.next)
        assert isinstance(action.name, str)


@pytest.mark.spec("PROTO-1", "PROTO-12")
def test_a_malformed_row_is_refused_when_it_is_written() -> None:
    ok = Row(Phase.IDLE, On.START, Role.ANY, Phase.SET_UP, Kind.LOCAL, step=Step.SET_UP)
    assert ok.step is Step.SET_UP
    with pytest.raises(ValueError, match="malformed row"):  # a local row without its step
        Row(Phase.IDLE, On.START, Role.ANY, Phase.SET_UP, Kind.LOCAL)
    with pytest.raises(ValueError, match="malformed row"):  # a step on a collective row
        Row(
            Phase.SET_UP,
            On.OK,
            Role.ANY,
            Phase.GATHER_PLANS,
            Kind.GATHER,
            step=Step.SET_UP,
            send=Slot.LOCAL_PLAN,
            recv=Slot.ALL_PLANS,
        )
    for kind in COLLECTIVES:  # a collective missing what it sends or what it receives
        for send, recv in ((None, Slot.ALL_PLANS), (Slot.LOCAL_PLAN, None), (None, None)):
            with pytest.raises(ValueError, match="malformed row"):
                Row(Phase.SET_UP, On.OK, Role.ANY, Phase.GATHER_PLANS, kind, send=send, recv=recv)
    # a return needs no slot, a collective with both slots is fine
    Row(Phase.GATHER_APPLIED, On.GOT_OK, Role.ANY, Phase.DONE, Kind.RETURN)
    Row(
        Phase.SET_UP,
        On.OK,
        Role.ANY,
        Phase.GATHER_PLANS,
        Kind.GATHER,
        send=Slot.LOCAL_PLAN,
        recv=Slot.ALL_PLANS,
    )


@pytest.mark.spec("PROTO-7", "PROTO-12", "PROTO-13")
@TABLES
@pytest.mark.parametrize("coordinator", [True, False])
def test_a_fault_on_a_rank_that_is_done_or_failed_ends_failed(name: str, coordinator: bool) -> None:
    table = _table(name)
    for phase in (Phase.DONE, Phase.FAILED):
        state = State(phase, 1, coordinator)
        new, action = table.transition(state, _event(On.ERR))
        assert new.phase is Phase.FAILED and action.kind is Kind.RAISE
        assert action.error is not None and 1 in action.error.rank_failures
        # the hook may raise again there: still failed, still raising
        again, action2 = table.transition(new, _event(On.ERR))
        assert again.phase is Phase.FAILED and action2.kind is Kind.RAISE


@pytest.mark.spec("PROTO-1")
@TABLES
def test_the_phase_list_starts_idle_and_lists_every_row_phase(name: str) -> None:
    table = _table(name)
    phases = table.phases
    assert phases[0] is Phase.IDLE
    assert phases == list(dict.fromkeys(p for r in table.rows for p in (r.phase, r.next)))


@pytest.mark.spec("PROTO-1", "PROTO-10")
@TABLES
def test_the_steps_are_exactly_those_the_local_rows_call(name: str) -> None:
    table = _table(name)
    steps = table.steps
    assert None not in steps
    assert steps == {r.step for r in table.rows if r.kind is Kind.LOCAL}
    assert all(isinstance(s, Step) for s in steps) and Step.SET_UP in steps
