"""Run one rank's protocol machine over a Communicator (PROTO-2).

The driver only executes; every decision lives in the protocol package
(Rule 1): the table says what to do next (``protocol/machine.py``), and
``protocol/outcomes.py`` says what a rank sends at a collective, which event
what it received is, and what a rank reports when a collective itself fails
(COMM-5) or ``finish`` raised (SAVE-16). Exceptions from local steps become
``err`` events (PROTO-4); a fault hook that raises is one more ``err`` event,
whatever the action (PROTO-7).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from refdcp.comm.base import Communicator
from refdcp.errors import CheckpointError, CommError, Failure
from refdcp.protocol.machine import Action, Event, Kind, On, State, Table
from refdcp.protocol.names import Slot, Step
from refdcp.protocol.outcomes import NOTHING, comm_failure, delivered, needs_payload, outgoing

__all__ = [
    "FaultHook",
    "Observer",
    "StepRecord",
    "apply_collective_result",
    "drive",
    "fault_event",
    "local_event",
    "record",
    "send_value",
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


def send_value(ctx: _Ctx, action: Action, world_size: int) -> Any:
    """What this rank sends at collective ``action`` (protocol/outcomes.py decides, PROTO-4)."""
    payload = (
        ctx.payload(action.send) if needs_payload(action) and action.send is not None else None
    )
    return outgoing(action, world_size, payload)


def terminal(ctx: _Ctx, action: Action) -> Any:
    """RETURN: the named result; RAISE: the agreed failures as a CheckpointError (ERR-1)."""
    if action.kind is Kind.RETURN:
        return ctx.result(action.send)
    assert action.error is not None
    return CheckpointError.from_report(action.error)


def apply_collective_result(
    ctx: _Ctx, state: State, action: Action, received: Any, receives: bool
) -> Event:
    """Store what a collective delivered, as protocol/outcomes.py says; return its event (PROTO-4)."""
    event, value = delivered(state, action, received, receives)
    if value is not NOTHING:
        assert action.recv is not None
        ctx.store(action.recv, value)
    return event


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
            received: Any = comm.gather(send_value(ctx, action, comm.world_size))
            return apply_collective_result(ctx, state, action, received, coordinator)
        if action.kind is Kind.ALL_GATHER:
            received = comm.all_gather(send_value(ctx, action, comm.world_size))
            return apply_collective_result(ctx, state, action, received, True)
        send = send_value(ctx, action, comm.world_size) if coordinator else None
        received = comm.scatter(send) if action.kind is Kind.SCATTER else comm.broadcast(send)
        return apply_collective_result(ctx, state, action, received, True)
    except CommError as exc:
        report = comm_failure(table, state, action, comm.rank, comm.coordinator_rank, exc)
        raise CheckpointError.from_report(report) from exc
