"""Every failure decision is the protocol's: ``protocol/outcomes.py`` searched, drivers scanned (PROTO-17)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import refdcp
from refdcp.errors_core import CommAborted, Failure, FailureReport, PeerLost
from refdcp.protocol import LOAD, SAVE, Kind, On, Phase, State
from refdcp.protocol.machine import FAN_IN, Action
from refdcp.protocol.outcomes import (
    NOTHING,
    comm_failure,
    declared,
    delivered,
    finish_failed,
    mark,
    outgoing,
    status_after_comm_error,
    with_declared_status,
)

ROOT = Path(refdcp.__file__).resolve().parent
DRIVERS = ["driver/run.py", "driver/simulator.py", "driver/steps.py", "reference/run.py"]
#: Names a driver must not use: they are decisions the protocol makes (PROTO-17).
DECISIONS = {
    "FailureReport",
    "PeerLost",
    "GOT_ERR",
    "GOT_OK",
    "SENT",
    "committed",
    "pending_phases",
}


def _failure(rank: int, step: str) -> Failure:
    return Failure.capture(rank, step, RuntimeError(f"boom on {rank}"))


@pytest.mark.spec("PROTO-17")
@pytest.mark.parametrize("module", DRIVERS)
def test_no_driver_makes_a_failure_decision(module: str) -> None:
    path = ROOT / module
    if not path.exists():
        assert module == "reference/run.py"  # the reference's driver, where it has one of its own
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for a in n.keywords if a.arg}
    assert not used & DECISIONS, f"{module} decides {sorted(used & DECISIONS)} itself"


collectives = [
    (table, row)
    for table in (SAVE, LOAD)
    for row in table.rows
    if row.kind in (Kind.GATHER, Kind.ALL_GATHER, Kind.SCATTER, Kind.BROADCAST)
]


@pytest.mark.spec("PROTO-17", "PROTO-4")
@given(
    pick=st.integers(0, len(collectives) - 1),
    world=st.integers(1, 6),
    failing=st.sets(st.integers(0, 5)),
    receives=st.booleans(),
)
def test_a_gathered_failure_is_got_err_naming_exactly_the_failing_ranks(
    pick: int, world: int, failing: set[int], receives: bool
) -> None:
    _, row = collectives[pick]
    action = Action(row.kind, row.next, row.step, row.send, row.recv)
    state = State(row.phase, 0, True)
    failing = {r for r in failing if r < world}
    if row.kind in FAN_IN:
        received = [
            _failure(r, f"step{r}") if r in failing else f"payload{r}" for r in range(world)
        ]
        event, value = delivered(state, action, received, receives)
        if not receives:
            assert (event.on, value) == (On.SENT, NOTHING)
        elif failing:
            assert event.on is On.GOT_ERR and value is NOTHING and event.error is not None
            assert set(event.error.rank_failures) == failing
            assert event.error.step == f"step{min(failing)}"
            assert event.error.committed is False
        else:
            assert (event.on, value) == (On.GOT_OK, received)
    else:
        report = FailureReport("write", {r: _failure(r, "write") for r in failing})
        received = report if failing else {"metadata": world}
        event, value = delivered(state, action, received, True)
        if failing:
            assert (event.on, event.error, value) == (On.GOT_ERR, report, NOTHING)
        else:
            assert (event.on, value) == (On.GOT_OK, received)


@pytest.mark.spec("PROTO-17", "PROTO-4")
@given(
    world=st.integers(1, 6),
    kind=st.sampled_from(sorted({row.kind for _, row in collectives})),
    holds=st.sampled_from(["none", "failure", "error"]),
)
def test_a_held_failure_or_report_replaces_the_payload(world: int, kind: Kind, holds: str) -> None:
    failure = _failure(0, "write") if holds == "failure" else None
    error = FailureReport("write", {1: _failure(1, "write")}) if holds == "error" else None
    action = Action(kind, Phase.GATHER_RESULTS, failure=failure, error=error)
    sent = outgoing(action, world, "payload")
    if holds == "failure":
        assert sent is failure
    elif holds == "error":
        assert sent == ([error] * world if kind is Kind.SCATTER else error)
    else:
        assert sent == "payload"


@pytest.mark.spec("PROTO-17", "COMM-61", "SAVE-15")
@given(
    world=st.integers(2, 6),
    rank=st.integers(0, 5),
    lost=st.sets(st.integers(0, 5), min_size=1),
    pick=st.integers(0, len(collectives) - 1),
)
def test_a_failed_collective_names_every_lost_rank(
    world: int, rank: int, lost: set[int], pick: int
) -> None:
    table, row = collectives[pick]
    rank %= world
    lost = {r % world for r in lost} - {rank} or {(rank + 1) % world}
    exc = CommAborted("gone")
    exc.ranks = tuple(sorted(lost))
    state = State(row.next, rank, rank == 0)
    action = Action(row.kind, row.next, None, row.send, row.recv)
    report = comm_failure(table, state, action, rank, 0, exc)
    assert set(report.rank_failures) == lost | {rank}
    assert all(isinstance(report.rank_failures[r].exception, PeerLost) for r in lost)
    assert report.committed == status_after_comm_error(table, state, exc, 0)
    if table is LOAD:
        assert report.committed is False


@pytest.mark.spec("PROTO-17", "SAVE-15")
def test_a_peer_after_sending_results_says_unknown_unless_the_coordinator_was_missing() -> None:
    state = State(Phase.GATHER_RESULTS, 1, False)
    exc = CommAborted("gone")
    exc.ranks = (2,)
    assert status_after_comm_error(SAVE, state, exc, 0) is None
    exc.ranks = (0,)
    assert status_after_comm_error(SAVE, state, exc, 0) is False
    after = State(Phase.BROADCAST_OUTCOME, 1, False)
    assert status_after_comm_error(SAVE, after, exc, 0) is None
    before = State(Phase.SCATTER_PLANS, 1, False)
    assert status_after_comm_error(SAVE, before, exc, 0) is False


@pytest.mark.spec("PROTO-17", "SAVE-16")
@pytest.mark.parametrize("declared_status", [True, False, None, "none"])
def test_a_failed_finish_reports_what_the_writer_declared(declared_status: object) -> None:
    exc = OSError("fsync failed")
    if declared_status != "none":
        mark(exc, declared_status)  # type: ignore[arg-type]
    finish_failed(exc)
    expected = None if declared_status == "none" else declared_status
    assert declared(exc) is expected
    report = FailureReport("commit", {0: Failure(0, "commit", exc, "")})
    got = with_declared_status(report).committed
    assert got is (False if expected is False else expected)
    other = FailureReport("write", {0: Failure(0, "write", exc, "")})
    assert with_declared_status(other).committed is False
