"""Failing peers are named: the error of a rank whose collective failed (COMM-60..COMM-62).

When a collective cannot complete, the waiting rank's :class:`CheckpointError`
carries its own failure (the :class:`CommError`) and, for every rank the
communicator knows did not join (``CommError.ranks``), a :class:`PeerLost`
failure naming that rank, so the message says who is missing or left, not
only "a peer". The commit status is the truthful one (SAVE-15).
"""

from __future__ import annotations

from refdcp.driver.commit_status import status_after_comm_error
from refdcp.errors import CheckpointError, CommError, Failure, PeerLost
from refdcp.protocol.machine import Action, State, Table

__all__ = ["PeerLost", "comm_failure_error"]


def comm_failure_error(
    table: Table,
    state: State,
    action: Action,
    rank: int,
    coordinator_rank: int,
    exc: CommError,
) -> CheckpointError:
    """The CheckpointError of ``rank`` after ``exc`` ended collective ``action`` (ERR-5, COMM-61)."""
    failures = {rank: Failure.capture(rank, action.phase, exc)}
    for other in exc.ranks:
        if other != rank:
            lost = PeerLost(
                f"rank {other} did not join the {action.phase!r} collective "
                f"(seen from rank {rank}): {exc}"
            )
            failures[other] = Failure(other, action.phase, lost, f"PeerLost: {lost}\n")
    committed = status_after_comm_error(table, state, exc, coordinator_rank)
    return CheckpointError(action.phase, failures, committed=committed)
