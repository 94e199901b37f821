"""What a rank does when something fails: every failure decision of the protocol (Rule 1).

``machine.py`` says what a rank does next; this module says how what the world
delivered becomes the machine's next event, and what a rank reports when the
world itself fails. A driver (``refdcp/driver/run.py``, the simulator,
``refdcp/reference/run.py``) only executes: it runs a local step, sends what
:func:`outgoing` says, feeds :func:`delivered`'s event back to the table, and
raises :func:`comm_failure`'s report when a collective cannot complete.

Worked example: **what if rank 2 of 4 fails during ``write``?**

1. Its ``write`` step raises. The driver feeds ``err`` with the captured
   :class:`Failure`; the row ``write --err--> gather_results`` (PROTO-5) keeps
   the failure in ``State.failure`` and asks for the results gather.
2. At the gather, :func:`outgoing` sends rank 2's failure in place of its
   write results (PROTO-4); ranks 0, 1 and 3 send their results.
3. On the coordinator, :func:`delivered` finds the failure among the gathered
   values and returns ``got_err`` with a report naming rank 2 and
   ``committed=False``; the row ``gather_results --got_err--> broadcast_outcome``
   (SAVE-7) skips the commit: ``StorageWriter.finish`` is never called.
4. At the broadcast, :func:`outgoing` on the coordinator sends the report in
   place of the metadata; every rank's :func:`delivered` turns it into
   ``got_err`` and the row ``broadcast_outcome --got_err--> failed`` raises the
   same :class:`CheckpointError` (step ``write``, rank 2's traceback,
   ``committed=False``) on all four ranks (ERR-1).

If instead rank 2's *process dies* during ``write``, it never joins the
gather: the communicator fails that collective on the other ranks
(``CommError`` naming rank 2, COMM-60), and :func:`comm_failure` builds each
rank's report: its own failure plus a :class:`PeerLost` for rank 2, with
``committed=False`` because nothing reached the commit (SAVE-15).

Commit status (SAVE-15, SAVE-16). ``committed=True`` only after the commit
row; ``False`` only where a rank *knows* the commit point was not passed;
``None`` ("unknown") where it cannot know: a ``finish`` that raised without
declaring (:func:`finish_failed`), or a peer that lost the coordinator after
sending its results.
"""

from __future__ import annotations

import contextlib
from typing import Any

from refdcp.errors_core import CommError, Failure, FailureReport, PeerLost
from refdcp.protocol.machine import COLLECTIVES, FAN_IN, Action, Event, Kind, On, State, Table
from refdcp.protocol.save import COMMIT_STEP

__all__ = [
    "COMMIT_ATTR",
    "MISSING",
    "NOTHING",
    "comm_failure",
    "declared",
    "delivered",
    "finish_failed",
    "mark",
    "needs_payload",
    "outgoing",
    "pending_phases",
    "status_after_comm_error",
    "with_declared_status",
]

#: What :func:`delivered` returns as the value to store when there is none.
NOTHING: Any = object()

#: The attribute a writer sets on an exception from ``finish`` (SAVE-16): True, False or None.
COMMIT_ATTR = "refdcp_committed"

#: What :func:`declared` returns for an exception without a mark.
MISSING: Any = object()


# -- sending and receiving (PROTO-4) --------------------------------------------------------


def needs_payload(action: Action) -> bool:
    """Whether this rank sends its own payload at collective ``action`` (PROTO-4)."""
    return action.failure is None and action.error is None


def outgoing(action: Action, world_size: int, payload: Any) -> Any:
    """What this rank sends at ``action``: a held failure or the merged report replaces the payload.

    At a fan-in collective a failed rank sends its :class:`Failure`; at a
    fan-out collective a coordinator holding failures sends their report (a
    scatter one per rank), with the status a failed ``finish`` declared
    (SAVE-16). ``payload`` is read only when :func:`needs_payload` is true.
    """
    if action.failure is not None:
        return action.failure
    if action.error is not None:
        error = with_declared_status(action.error)
        return [error] * world_size if action.kind is Kind.SCATTER else error
    return payload


def delivered(state: State, action: Action, received: Any, receives: bool) -> tuple[Event, Any]:
    """The machine's event for what collective ``action`` delivered, and the value to store.

    A gather on a rank that receives nothing is ``sent``. Failures among
    gathered values become one report, first failing rank's step first
    (ERR-3); a fan-out that delivers a report is ``got_err``; anything else is
    ``got_ok`` with the value for ``action.recv`` (PROTO-4).
    """
    if action.kind not in COLLECTIVES:
        raise ValueError(f"{action.kind} is not a collective")
    if action.kind in FAN_IN:
        if not receives:
            return Event(On.SENT), NOTHING
        failures = {r: v for r, v in enumerate(received) if isinstance(v, Failure)}
        if failures:
            report = FailureReport(failures[min(failures)].step, failures, state.committed)
            return Event(On.GOT_ERR, error=report), NOTHING
        return Event(On.GOT_OK), received
    if isinstance(received, FailureReport):
        return Event(On.GOT_ERR, error=received), NOTHING
    return Event(On.GOT_OK), received


# -- a collective that cannot complete (COMM-5, COMM-61) ------------------------------------


def comm_failure(
    table: Table, state: State, action: Action, rank: int, coordinator_rank: int, exc: CommError
) -> FailureReport:
    """This rank's report when collective ``action`` itself failed (COMM-5, COMM-61, SAVE-15).

    Its own failure (the :class:`CommError`) plus a :class:`PeerLost` for every
    rank the communicator knows did not join, with the truthful commit status.
    """
    failures = {rank: Failure.capture(rank, action.phase, exc)}
    for other in exc.ranks:
        if other != rank:
            lost = PeerLost(
                f"rank {other} did not join the {action.phase!r} collective "
                f"(seen from rank {rank}): {exc}"
            )
            failures[other] = Failure(other, action.phase, lost, f"PeerLost: {lost}\n")
    committed = status_after_comm_error(table, state, exc, coordinator_rank)
    return FailureReport(action.phase, failures, committed=committed)


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
    """What a rank may say about the commit when a collective failed (SAVE-15).

    The coordinator knows whether its ``finish`` returned. A peer that has sent
    its results may have lost a coordinator that committed and then died: it
    says "unknown" unless the communicator names the coordinator as missing
    from the results gather; after the commit step it always says "unknown".
    """
    if state.committed or state.coordinator:
        return state.committed
    before, after = pending_phases(table)
    if state.phase in after:
        return None
    if state.phase in before:
        return False if coordinator_rank in exc.ranks else None
    return False


# -- a commit step that raised (SAVE-16) ----------------------------------------------------


def mark(exc: BaseException, committed: bool | None) -> None:
    """A writer records on ``exc`` whether its commit point had passed when it raised (SAVE-16)."""
    with contextlib.suppress(AttributeError, TypeError):  # a type that takes no attributes
        setattr(exc, COMMIT_ATTR, committed)


def declared(exc: BaseException) -> Any:
    """The status recorded on ``exc`` by :func:`mark`, or :data:`MISSING` (SAVE-16)."""
    return getattr(exc, COMMIT_ATTR, MISSING)


def finish_failed(exc: BaseException) -> None:
    """``StorageWriter.finish`` raised: keep what the writer declared, else "unknown" (SAVE-16)."""
    if declared(exc) is MISSING:
        mark(exc, None)


def with_declared_status(error: FailureReport) -> FailureReport:
    """The coordinator's report, with the status its failed ``finish`` declared (SAVE-16).

    Only a failure at the commit step changes the status; any other failure
    leaves it as the machine saw it.
    """
    if error.committed is not False:
        return error
    for f in error.rank_failures.values():
        if f.step == COMMIT_STEP:
            status = declared(f.exception)
            if status is not MISSING and status is not False:
                return FailureReport(error.step, error.rank_failures, committed=status)
    return error
