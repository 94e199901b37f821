"""Truthful commit status of a failed save: True, False, or None for "unknown" (SAVE-15, SAVE-16).

A rank may only report ``committed=False`` when it knows the commit point was
not passed. Three cases used to report a false "not committed":

* ``StorageWriter.finish`` raised. A writer may raise after its commit point
  (refdcp's filesystem writer: the directory fsync after the rename). The
  commit step marks every exception from ``finish`` with the status the
  writer declared (:func:`mark`), or None when it declared nothing.
* A peer lost the coordinator after sending its write results: the
  coordinator may have committed and then died before broadcasting. Unless
  the communicator says the coordinator never joined the results gather, the
  status is None.
* The same for a broadcast of the outcome that never arrives: None.
"""

from __future__ import annotations

from refdcp.errors import CheckpointError, CommError, FailureReport
from refdcp.protocol.machine import COLLECTIVES, State, Table
from refdcp.protocol.save import COMMIT_STEP
from refdcp.storage.fs.commit_mark import COMMIT_ATTR, MISSING, declared, mark

__all__ = [
    "COMMIT_ATTR",
    "declared",
    "mark",
    "mark_finish_error",
    "pending_phases",
    "with_declared_status",
    "status_after_comm_error",
    "with_status",
]


def mark_finish_error(exc: BaseException) -> None:
    """``StorageWriter.finish`` raised: keep what the writer declared, else "unknown" (SAVE-16)."""
    if declared(exc) is MISSING:
        mark(exc, None)


def with_declared_status(error: FailureReport) -> FailureReport:
    """The coordinator's error, with the status its failed ``finish`` declared (SAVE-16).

    Only a failure at the commit step whose exception was marked by the commit
    step changes the status; any other failure leaves it as the machine saw it.
    """
    if error.committed is not False:
        return error
    for f in error.rank_failures.values():
        if f.step == COMMIT_STEP:
            status = declared(f.exception)
            if status is not MISSING and status is not False:
                return FailureReport(error.step, error.rank_failures, committed=status)
    return error


def pending_phases(table: Table) -> tuple[frozenset[str], frozenset[str]]:
    """(phases in which a peer has sent its results, phases after the commit step) of ``table``.

    Derived from the rows: the collective leading into the commit step, and the
    collectives that follow it. Empty for a table without a commit (load).
    """
    commit_rows = [r for r in table.rows if r.commits and r.kind in COLLECTIVES]
    commit_phases = {r.phase for r in commit_rows}
    before = frozenset(r.phase for r in table.rows if r.next in commit_phases)
    after = frozenset(r.next for r in commit_rows)
    return before, after


def status_after_comm_error(
    table: Table, state: State, exc: CommError, coordinator_rank: int
) -> bool | None:
    """What a rank may say about the commit when a collective failed (SAVE-15)."""
    if state.committed or state.coordinator:
        return state.committed  # the coordinator knows whether its finish returned
    before, after = pending_phases(table)
    if state.phase in after:
        return None
    if state.phase in before:
        missing = getattr(exc, "ranks", ())
        return False if coordinator_rank in missing else None
    return False


def with_status(error: CheckpointError, committed: bool | None) -> CheckpointError:
    """``error`` with ``committed`` replaced."""
    if error.committed is committed:
        return error
    return CheckpointError(error.step, error.rank_failures, committed=committed)
