"""TEMPORARY stand-in for refdcp.protocol.outcomes until the integrator's version lands (PROTO-4)."""

from __future__ import annotations

from typing import Any

from refdcp.driver.commit_status import mark_finish_error, with_declared_status
from refdcp.driver.peers import comm_failure_error
from refdcp.errors import CommError, Failure, FailureReport
from refdcp.protocol.machine import FAN_IN, Action, Event, Kind, On, State, Table

NOTHING: Any = object()


def needs_payload(action: Action) -> bool:
    """PROTO-4."""
    return (action.failure if action.kind in FAN_IN else action.error) is None


def outgoing(action: Action, world_size: int, payload: Any) -> Any:
    """PROTO-4."""
    if action.kind in FAN_IN:
        return action.failure if action.failure is not None else payload
    if action.error is not None:
        error = with_declared_status(action.error)
        return [error] * world_size if action.kind is Kind.SCATTER else error
    return payload


def delivered(state: State, action: Action, received: Any, receives: bool) -> tuple[Event, Any]:
    """PROTO-4."""
    if action.kind in FAN_IN:
        if not receives:
            return Event(On.SENT), NOTHING
        failures = {r: v for r, v in enumerate(received) if isinstance(v, Failure)}
        if failures:
            first = failures[min(failures)]
            report = FailureReport(first.step, failures, committed=state.committed)
            return Event(On.GOT_ERR, error=report), NOTHING
        return Event(On.GOT_OK), received
    if isinstance(received, FailureReport):
        return Event(On.GOT_ERR, error=received), NOTHING
    return Event(On.GOT_OK), received


def comm_failure(
    table: Table, state: State, action: Action, rank: int, coordinator_rank: int, exc: CommError
) -> FailureReport:
    """COMM-5."""
    return comm_failure_error(table, state, action, rank, coordinator_rank, exc).report


def finish_failed(exc: BaseException) -> None:
    """SAVE-16."""
    mark_finish_error(exc)
