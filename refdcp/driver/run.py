"""Run one rank's protocol machine over a Communicator (PROTO-2).

The driver is the only place where the machine's actions meet the world:
local steps call planners and storage; collectives go through the
Communicator. Exceptions from local steps become failures that travel through
the next collective (PROTO-4). A collective that itself fails (timeout, a
peer left) ends this rank at once with a CheckpointError (COMM-5). A fault
hook that raises is one more ``err`` event for the machine, whatever the
action (PROTO-7); what follows, including after the last action, is the
table's business (``done --err--> failed``), not the driver's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from refdcp.comm.base import Communicator
from refdcp.driver.commit_status import with_declared_status
from refdcp.driver.peers import comm_failure_error
from refdcp.errors import CheckpointError, CommError, Failure, FailureReport
from refdcp.protocol.machine import Action, Event, Kind, On, State, Table
from refdcp.protocol.names import Slot, Step

__all__ = [
    "FaultHook",
    "Observer",
    "StepRecord",
    "apply_collective_result",
    "drive",
    "fault_event",
    "local_event",
    "record",
    "step_name",
    "terminal",
]


class _Ctx(Protocol):
    rank: int

    def run(self, step: Step) -> None: ...
    def payload(self, slot: Slot) -> Any: ...
    def store(self, slot: Slot, value: Any) -> None: ...
    def result(self, slot: Slot | None) -> Any: ...


@dataclass(frozen=True)
class StepRecord:
    """What one rank did at one step: for ``refdcp trace`` and tests."""

    rank: int
    index: int
    phase: str
    kind: Kind
    step: str
    outcome: On
    seconds: float


#: Called before action ``index`` of a rank; raising injects a fault there (PROTO-7).
FaultHook = Callable[[int, Action], None]
Observer = Callable[[StepRecord], None]


def step_name(action: Action) -> str:
    """The name a failure at ``action`` is reported under (ERR-4)."""
    return str(action.step) if action.step is not None else str(action.phase)


def record(state: State, index: int, action: Action, on: On, seconds: float) -> StepRecord:
    return StepRecord(state.rank, index, str(action.phase), action.kind, action.name, on, seconds)


def fault_event(rank: int, action: Action, exc: BaseException) -> Event:
    """A fault hook raised before ``action``: an ``err`` event like any other (PROTO-7)."""
    return Event(On.ERR, failure=Failure.capture(rank, step_name(action), exc))


def local_event(ctx: _Ctx, action: Action) -> Event:
    assert action.step is not None
    try:
        ctx.run(action.step)
    except Exception as exc:
        return Event(On.ERR, failure=Failure.capture(ctx.rank, str(action.step), exc))
    return Event(On.OK)


def fan_in_payload(ctx: _Ctx, action: Action) -> Any:
    if action.failure is not None:
        return action.failure
    assert action.send is not None
    return ctx.payload(action.send)


def fan_out_payload(ctx: _Ctx, action: Action, world_size: int) -> Any:
    if action.error is not None:
        error = with_declared_status(action.error)  # the status a failed finish declared (SAVE-16)
        return [error] * world_size if action.kind is Kind.SCATTER else error
    assert action.send is not None
    return ctx.payload(action.send)


def terminal(ctx: _Ctx, action: Action) -> Any:
    """RETURN: the named result; RAISE: the agreed failures as a CheckpointError (ERR-1)."""
    if action.kind is Kind.RETURN:
        return ctx.result(action.send)
    assert action.error is not None
    return CheckpointError.from_report(action.error)


def apply_collective_result(
    ctx: _Ctx, state: State, action: Action, received: Any, receives: bool
) -> Event:
    """Turn what a collective delivered into the machine's event (PROTO-4)."""
    if action.kind in (Kind.GATHER, Kind.ALL_GATHER):
        if not receives:
            return Event(On.SENT)
        failures = {r: v for r, v in enumerate(received) if isinstance(v, Failure)}
        if failures:
            first = failures[min(failures)]
            report = FailureReport(first.step, failures, committed=state.committed)
            return Event(On.GOT_ERR, error=report)
        assert action.recv is not None
        ctx.store(action.recv, received)
        return Event(On.GOT_OK)
    if isinstance(received, FailureReport):
        return Event(On.GOT_ERR, error=received)
    assert action.recv is not None
    ctx.store(action.recv, received)
    return Event(On.GOT_OK)


def drive(
    table: Table,
    ctx: _Ctx,
    comm: Communicator,
    *,
    fault: FaultHook | None = None,
    observer: Observer | None = None,
) -> Any:
    """Run the machine to its end; return its result or raise its CheckpointError."""
    coordinator = comm.rank == comm.coordinator_rank
    state, action = table.start(comm.rank, coordinator)
    index = 0
    # A KeyboardInterrupt or SystemExit is sent to the peers like any failure, and
    # re-raised once the protocol has ended, so peers learn of it at once (ERR-10).
    interrupt: BaseException | None = None
    while True:
        if fault is not None and state.failure is None:  # a failed rank only reports (PROTO-7)
            try:
                fault(index, action)
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    interrupt = exc
                event = fault_event(comm.rank, action, exc)
                if observer is not None:
                    observer(record(state, index, action, event.on, 0.0))
                state, action = table.transition(state, event)
                index += 1
                continue
        if interrupt is not None and action.kind in (Kind.RETURN, Kind.RAISE):
            raise interrupt
        if action.kind is Kind.RETURN:
            return ctx.result(action.send)
        if action.kind is Kind.RAISE:
            assert action.error is not None
            raise CheckpointError.from_report(action.error)
        t0 = time.perf_counter()
        if action.kind is Kind.LOCAL:
            try:
                event = local_event(ctx, action)
            except BaseException as exc:  # KeyboardInterrupt, SystemExit (ERR-10)
                interrupt = exc
                event = Event(On.ERR, failure=Failure.capture(ctx.rank, step_name(action), exc))
        else:
            event = _collective(ctx, state, action, comm, table)
        if observer is not None:
            observer(record(state, index, action, event.on, time.perf_counter() - t0))
        state, action = table.transition(state, event)
        index += 1


def _collective(ctx: _Ctx, state: State, action: Action, comm: Communicator, table: Table) -> Event:
    coordinator = comm.rank == comm.coordinator_rank
    try:
        if action.kind is Kind.GATHER:
            received: Any = comm.gather(fan_in_payload(ctx, action))
            return apply_collective_result(ctx, state, action, received, coordinator)
        if action.kind is Kind.ALL_GATHER:
            received = comm.all_gather(fan_in_payload(ctx, action))
            return apply_collective_result(ctx, state, action, received, True)
        send = fan_out_payload(ctx, action, comm.world_size) if coordinator else None
        received = comm.scatter(send) if action.kind is Kind.SCATTER else comm.broadcast(send)
        return apply_collective_result(ctx, state, action, received, True)
    except CommError as exc:
        raise comm_failure_error(
            table, state, action, comm.rank, comm.coordinator_rank, exc
        ) from exc
