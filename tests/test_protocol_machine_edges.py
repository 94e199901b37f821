"""Edges of the protocol machine the mutation run found untested (spec/protocol.md PROTO-3, ERR-3)."""

from __future__ import annotations

import pytest

from refdcp.errors_core import Failure, FailureReport
from refdcp.protocol.machine import Kind, On, Role, Row, State, Table, merged_error
from refdcp.protocol.names import Phase, Step


@pytest.mark.spec("PROTO-3")
def test_a_table_with_two_rows_for_one_key_is_refused() -> None:
    row = Row(Phase.IDLE, On.START, Role.ANY, Phase.SET_UP, Kind.LOCAL, step=Step.SET_UP)
    other = Row(Phase.IDLE, On.START, Role.ANY, Phase.DONE, Kind.LOCAL, step=Step.SET_UP)
    with pytest.raises(ValueError, match="two rows"):
        Table("t", [row, other])


@pytest.mark.spec("ERR-3", "SAVE-9")
@pytest.mark.parametrize(
    ("own", "agreed", "expected"),
    [(False, True, True), (True, False, True), (False, False, False), (False, None, None)],
)
def test_merged_failures_keep_the_commit_status_either_side_knows(
    own: bool, agreed: bool | None, expected: bool | None
) -> None:
    """A rank that did not see the commit still reports it when the agreed failures say so."""
    theirs = Failure(1, "commit", RuntimeError("x"), "tb")
    mine = Failure(0, "broadcast_outcome", RuntimeError("y"), "tb")
    state = State(
        Phase.BROADCAST_OUTCOME,
        rank=0,
        coordinator=False,
        failure=mine,
        error=FailureReport("commit", {1: theirs}, committed=agreed),
        committed=own,
    )
    report = merged_error(state)
    assert report.step == "commit"  # the agreed failure's step, not this rank's phase
    assert report.committed is expected
    assert sorted(report.rank_failures) == [0, 1]
