"""Generic sans-I/O protocol machine: a transition table and a pure transition function.

A machine is data (:class:`Table`, a list of :class:`Row`) plus
:func:`Table.transition`, a pure function ``(State, Event) -> (State, Action)``
(PROTO-1). It performs no I/O, no collectives and starts no threads; a driver
executes the returned :class:`Action` and feeds the outcome back as an
:class:`Event`.

Failures are data (PROTO-4): a local failure is kept in ``State.failure`` and
sent at the next collective instead of the payload; a collective that delivers
a failure puts the agreed :class:`~refdcp.errors.CheckpointError` in
``State.error``. While a rank holds a failure it skips local actions and only
takes part in collectives, so every rank reaches the same terminal state and
no rank is left waiting (PROTO-5).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from refdcp.errors import CheckpointError, Failure, ProtocolError

__all__ = [
    "Action",
    "Event",
    "FAN_IN",
    "FAN_OUT",
    "Kind",
    "On",
    "Role",
    "Row",
    "State",
    "Table",
    "COLLECTIVES",
    "IDLE",
]

#: Phase every machine starts in.
IDLE = "idle"


class On(str, Enum):
    """What happened to the last action."""

    START = "start"  # the driver starts the machine
    OK = "ok"  # a local action returned
    ERR = "err"  # a local action raised, or a fault hit this rank before its action
    SENT = "sent"  # a gather completed on a rank that receives nothing
    GOT_OK = "got_ok"  # a collective delivered values and no failure
    GOT_ERR = "got_err"  # a collective delivered a failure


class Kind(str, Enum):
    """What the driver must do next."""

    LOCAL = "local"  # call a local step (planner / storage / Stateful)
    GATHER = "gather"  # every rank sends, the coordinator receives the list
    SCATTER = "scatter"  # the coordinator sends one object per rank
    BROADCAST = "broadcast"  # the coordinator sends one object to every rank
    ALL_GATHER = "all_gather"  # every rank sends, every rank receives the list
    RETURN = "return"  # terminal: return the named result
    RAISE = "raise"  # terminal: raise ``Action.error``


FAN_IN = frozenset({Kind.GATHER, Kind.ALL_GATHER})
FAN_OUT = frozenset({Kind.SCATTER, Kind.BROADCAST})
COLLECTIVES = FAN_IN | FAN_OUT
TERMINAL = frozenset({Kind.RETURN, Kind.RAISE})


class Role(str, Enum):
    ANY = "any"
    COORD = "coordinator"
    PEER = "peer"


@dataclass(frozen=True)
class Row:
    """One transition: in ``phase``, on ``on`` (for ``role``), go to ``next`` and do ``kind``.

    ``step`` names the local step to call, or the context slot a collective
    sends; ``recv`` names the slot its result goes to. ``commits`` marks the
    rows that pass the commit point (SAVE-6). ``req`` is the spec ID the row
    implements.
    """

    phase: str
    on: On
    next: str
    kind: Kind
    step: str = ""
    recv: str = ""
    role: Role = Role.ANY
    commits: bool = False
    req: str = ""


@dataclass(frozen=True)
class State:
    phase: str
    rank: int
    coordinator: bool
    failure: Failure | None = None
    error: CheckpointError | None = None
    committed: bool = False


@dataclass(frozen=True)
class Event:
    on: On
    failure: Failure | None = None
    error: CheckpointError | None = None


@dataclass(frozen=True)
class Action:
    """A request to the driver.

    For fan-in collectives ``failure`` (when set) is sent instead of the
    payload; for fan-out collectives on the coordinator, ``error`` (when set)
    is sent to every rank instead of the payload; for RAISE it is the error.
    """

    kind: Kind
    phase: str
    step: str = ""
    recv: str = ""
    failure: Failure | None = None
    error: CheckpointError | None = None


class Table:
    """A protocol's transition table (data) and its pure transition function."""

    def __init__(self, name: str, rows: Iterable[Row]) -> None:
        self.name = name
        explicit = list(rows)
        self.rows: list[Row] = explicit + _retry_rows(explicit)
        self._index: dict[tuple[str, On, Role], Row] = {}
        for row in self.rows:
            key = (row.phase, row.on, row.role)
            if key in self._index:
                raise ValueError(f"{name}: two rows for {key}")
            self._index[key] = row

    @property
    def phases(self) -> list[str]:
        seen: dict[str, None] = {}
        for row in self.rows:
            seen.setdefault(row.phase)
            seen.setdefault(row.next)
        return list(seen)

    def lookup(self, phase: str, on: On, coordinator: bool) -> Row:
        role = Role.COORD if coordinator else Role.PEER
        row = self._index.get((phase, on, role)) or self._index.get((phase, on, Role.ANY))
        if row is None:
            raise ProtocolError(
                "PROTO-3",
                f"{self.name} protocol: event {on.value!r} is not allowed in phase "
                f"{phase!r} on the {role.value}",
            )
        return row

    def start(self, rank: int, coordinator: bool) -> tuple[State, Action]:
        return self.transition(State(IDLE, rank, coordinator), Event(On.START))

    def transition(self, state: State, event: Event) -> tuple[State, Action]:
        """Pure: the next state and the action to perform (PROTO-1)."""
        if event.on is On.ERR and event.failure is None:
            raise ProtocolError("PROTO-4", "an ERR event must carry the failure")
        if event.on is On.GOT_ERR and event.error is None:
            raise ProtocolError("PROTO-4", "a GOT_ERR event must carry the error")
        row = self.lookup(state.phase, event.on, state.coordinator)
        new = replace(
            state,
            phase=row.next,
            failure=state.failure or event.failure,
            error=event.error if event.on is On.GOT_ERR else state.error,
            committed=state.committed or row.commits,
        )
        # A rank holding a failure skips its local steps: it only joins collectives (PROTO-5).
        while row.kind is Kind.LOCAL and new.failure is not None:
            row = self.lookup(new.phase, On.ERR, new.coordinator)
            new = replace(new, phase=row.next, committed=new.committed or row.commits)
        return new, _action(row, new)


def merged_error(state: State) -> CheckpointError:
    """The agreed error plus this rank's own failure, if any (ERR-3)."""
    failures: dict[int, Failure] = {}
    step = ""
    committed: bool | None = state.committed
    if state.error is not None:
        failures.update(state.error.rank_failures)
        step = state.error.step
        committed = committed or state.error.committed
    if state.failure is not None:
        failures.setdefault(state.rank, state.failure)
        step = step or state.failure.step
    return CheckpointError(step or state.phase, failures, committed=committed)


def _action(row: Row, state: State) -> Action:
    kind = row.kind
    if kind in FAN_IN:
        return Action(kind, row.next, row.step, row.recv, failure=state.failure)
    if kind in FAN_OUT:
        err = None
        if state.coordinator and (state.failure is not None or state.error is not None):
            err = merged_error(state)
        return Action(kind, row.next, row.step, row.recv, error=err)
    if kind is Kind.RETURN and state.failure is not None:
        # Everyone else succeeded but this rank failed after its last collective (SAVE-9).
        return Action(Kind.RAISE, row.next, error=merged_error(state))
    if kind is Kind.RAISE:
        return Action(Kind.RAISE, row.next, error=merged_error(state))
    return Action(kind, row.next, row.step, row.recv)


def _retry_rows(rows: list[Row]) -> list[Row]:
    """A fault before a collective re-issues it, carrying the failure (PROTO-5)."""
    out: list[Row] = []
    seen: set[tuple[str, Role]] = set()
    have = {(r.phase, r.on, r.role) for r in rows}
    for row in rows:
        if row.kind in COLLECTIVES and (row.next, row.role) not in seen:
            seen.add((row.next, row.role))
            if (row.next, On.ERR, row.role) not in have and (
                row.next,
                On.ERR,
                Role.ANY,
            ) not in have:
                out.append(
                    Row(
                        row.next,
                        On.ERR,
                        row.next,
                        row.kind,
                        row.step,
                        row.recv,
                        row.role,
                        req="PROTO-5",
                    )
                )
    return out
