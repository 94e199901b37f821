"""Protocol tables: malformed events are refused, the phase list is complete (PROTO-1, PROTO-3, PROTO-4)."""

from __future__ import annotations

import pytest

from refdcp.errors import CheckpointError, Failure, ProtocolError
from refdcp.protocol.load import LOAD
from refdcp.protocol.machine import IDLE, Event, On, State
from refdcp.protocol.save import SAVE


@pytest.mark.spec("PROTO-4")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=["save", "load"])
def test_failure_events_must_carry_their_failure(table: object) -> None:
    from refdcp.protocol.machine import Table

    assert isinstance(table, Table)
    state, _ = table.start(0, True)
    with pytest.raises(ProtocolError, match="ERR event must carry the failure"):
        table.transition(state, Event(On.ERR))
    with pytest.raises(ProtocolError, match="GOT_ERR event must carry the error"):
        table.transition(State("gather_plans", 0, True), Event(On.GOT_ERR))
    fail = Failure(rank=0, step="set_up", exception=RuntimeError("x"), traceback_text="")
    after, _ = table.transition(state, Event(On.ERR, failure=fail))
    assert after.failure is fail
    err = CheckpointError("local_plan", {0: fail})
    got, _ = table.transition(State("gather_plans", 0, True), Event(On.GOT_ERR, error=err))
    assert got.error is err


@pytest.mark.spec("PROTO-1")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=["save", "load"])
def test_phase_list_names_every_phase_once_starting_idle(table: object) -> None:
    from refdcp.protocol.machine import Table

    assert isinstance(table, Table)
    phases = table.phases
    assert phases[0] == IDLE and len(phases) == len(set(phases))
    assert set(phases) == {r.phase for r in table.rows} | {r.next for r in table.rows}
    assert {"done", "failed"} <= set(phases)


@pytest.mark.spec("SAVE-9", "PROTO-5")
def test_a_rank_that_failed_after_its_last_collective_raises_instead_of_returning() -> None:
    from refdcp.protocol.machine import Kind

    fail = Failure(rank=1, step="after", exception=RuntimeError("late"), traceback_text="")
    state = State("broadcast_outcome", 1, False, failure=fail, committed=True)
    _, action = SAVE.transition(state, Event(On.GOT_OK))
    assert action.kind is Kind.RAISE and action.error is not None
    assert action.error.committed and 1 in action.error.rank_failures
    ok, clean = SAVE.transition(
        State("broadcast_outcome", 1, False, committed=True), Event(On.GOT_OK)
    )
    assert clean.kind is Kind.RETURN and clean.error is None and ok.phase == "done"
