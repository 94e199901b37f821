"""Generic sans-I/O protocol machine: a transition table and a pure transition function.

**Rule 1.** One rank's machine does exactly what the row for its
``(phase, event, role)`` says, and nothing else: every transition of the save
and load protocols is one literal row of ``SAVE`` (``protocol/save.py``) or
``LOAD`` (``protocol/load.py``); an event with no row raises
:class:`~refdcp.errors.ProtocolError` (PROTO-3). :meth:`Table.transition` is a
pure function ``(State, Event) -> (State, Action)`` (PROTO-1): no I/O, no
collective, no thread; a driver executes the :class:`Action` and feeds the
outcome back as an :class:`Event` (PROTO-2).

Failures are data (PROTO-4). Two bookkeeping rules apply to every row, and
are coded here once (:meth:`Table.transition`, :func:`_action`):

* **A failed rank does no work of its own** (PROTO-5, SAVE-9). A local failure
  (an ``err`` event) is kept in ``State.failure``. While a rank holds one, a
  row that would call a local step or return is replaced by its next phase's
  ``err`` row: the rank skips its steps, still joins every collective, and
  raises at the end instead of returning (the ``done --err--> failed`` row).
  A fault after a rank's last action is the same ``err`` event in ``done``.
* **A failure travels in place of the payload** (PROTO-4). At a fan-in
  collective a rank holding a failure sends it instead of its payload; at a
  fan-out collective a coordinator holding a failure, or the agreed failures,
  sends their merged :class:`~refdcp.errors.FailureReport` instead of its
  payload. A collective that delivers failures puts the agreed report in
  ``State.error``.

Every rank therefore reaches the same terminal state and no rank is left
waiting at a collective (PROTO-5).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from refdcp.errors_core import Failure, FailureReport, ProtocolError
from refdcp.protocol.names import Phase, Slot, Step

__all__ = [
    "Action",
    "COLLECTIVES",
    "Effect",
    "Event",
    "FAN_IN",
    "FAN_OUT",
    "IDLE",
    "Kind",
    "On",
    "RAISE",
    "Role",
    "Row",
    "State",
    "TERMINAL",
    "Table",
    "all_gather",
    "broadcast",
    "call",
    "gather",
    "merged_error",
    "ret",
    "scatter",
]

#: Phase every machine starts in.
IDLE = Phase.IDLE


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
    RETURN = "return"  # terminal: return the named slot (or None)
    RAISE = "raise"  # terminal: raise ``Action.error``


FAN_IN = frozenset({Kind.GATHER, Kind.ALL_GATHER})
FAN_OUT = frozenset({Kind.SCATTER, Kind.BROADCAST})
COLLECTIVES = FAN_IN | FAN_OUT
TERMINAL = frozenset({Kind.RETURN, Kind.RAISE})


class Role(str, Enum):
    ANY = "any"
    COORD = "coordinator"
    PEER = "peer"


#: What a row does: (kind, local step, slot sent or returned, slot received).
Effect = tuple[Kind, Step | None, Slot | None, Slot | None]


def call(step: Step) -> Effect:
    """Call the local step ``step``."""
    return (Kind.LOCAL, step, None, None)


def gather(send: Slot, recv: Slot) -> Effect:
    return (Kind.GATHER, None, send, recv)


def all_gather(send: Slot, recv: Slot) -> Effect:
    return (Kind.ALL_GATHER, None, send, recv)


def scatter(send: Slot, recv: Slot) -> Effect:
    return (Kind.SCATTER, None, send, recv)


def broadcast(send: Slot, recv: Slot) -> Effect:
    return (Kind.BROADCAST, None, send, recv)


def ret(slot: Slot | None = None) -> Effect:
    """Return the value in ``slot`` (None when no slot)."""
    return (Kind.RETURN, None, slot, None)


#: Raise the agreed failures as a CheckpointError.
RAISE: Effect = (Kind.RAISE, None, None, None)


@dataclass(frozen=True)
class Row:
    """One transition: in ``phase``, on ``on``, for ``role``, go to ``next`` and do ``kind``.

    ``step`` is the local step a LOCAL row calls; ``send`` the context slot a
    collective sends (or RETURN returns); ``recv`` the slot a collective's
    result goes to. ``commits`` marks the rows that pass the commit point
    (SAVE-6). ``req`` is the spec ID the row implements.
    """

    phase: Phase
    on: On
    role: Role
    next: Phase
    kind: Kind
    step: Step | None = None
    send: Slot | None = None
    recv: Slot | None = None
    req: str = ""
    commits: bool = False

    def __post_init__(self) -> None:
        local = self.kind is Kind.LOCAL
        collective = self.kind in COLLECTIVES
        if (self.step is not None) != local or (collective and None in (self.send, self.recv)):
            raise ValueError(f"malformed row {self}")


@dataclass(frozen=True)
class State:
    phase: Phase
    rank: int
    coordinator: bool
    failure: Failure | None = None
    error: FailureReport | None = None
    committed: bool = False


@dataclass(frozen=True)
class Event:
    on: On
    failure: Failure | None = None
    error: FailureReport | None = None


@dataclass(frozen=True)
class Action:
    """A request to the driver.

    For fan-in collectives ``failure`` (when set) is sent instead of the
    payload; for fan-out collectives on the coordinator, ``error`` (when set)
    is sent to every rank instead of the payload; for RAISE it is the error.
    """

    kind: Kind
    phase: Phase
    step: Step | None = None
    send: Slot | None = None
    recv: Slot | None = None
    failure: Failure | None = None
    error: FailureReport | None = None

    @property
    def name(self) -> str:
        """The local step, else the slot sent or returned, else the phase (for traces)."""
        return str(self.step or self.send or self.phase)


class Table:
    """A protocol's transition table (data) and its pure transition function."""

    def __init__(self, name: str, rows: Iterable[Row]) -> None:
        self.name = name
        self.rows: list[Row] = list(rows)
        self._index: dict[tuple[Phase, On, Role], Row] = {}
        for row in self.rows:
            key = (row.phase, row.on, row.role)
            if key in self._index:
                raise ValueError(f"{name}: two rows for {key}")
            self._index[key] = row

    @property
    def phases(self) -> list[Phase]:
        seen: dict[Phase, None] = {}
        for row in self.rows:
            seen.setdefault(row.phase)
            seen.setdefault(row.next)
        return list(seen)

    @property
    def steps(self) -> frozenset[Step]:
        """Every local step a row calls."""
        return frozenset(row.step for row in self.rows if row.step is not None)

    def lookup(self, phase: Phase, on: On, coordinator: bool) -> Row:
        role = Role.COORD if coordinator else Role.PEER
        row = self._index.get((phase, on, role)) or self._index.get((phase, on, Role.ANY))
        if row is None:
            raise ProtocolError(
                "PROTO-3",
                f"{self.name} protocol: event {on.value!r} is not allowed in phase "
                f"{str(phase)!r} on the {role.value}",
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
        # A failed rank does no work of its own: it takes the err row instead (PROTO-5).
        hops = 0
        while new.failure is not None and row.kind in (Kind.LOCAL, Kind.RETURN):
            hops += 1
            if hops > len(self.rows):  # err rows that never reach a collective or an end
                raise ProtocolError(
                    "PROTO-5", f"{self.name} protocol: the err rows from {str(state.phase)!r} loop"
                )
            row = self.lookup(new.phase, On.ERR, new.coordinator)
            new = replace(new, phase=row.next, committed=new.committed or row.commits)
        return new, _action(row, new)


def merged_error(state: State) -> FailureReport:
    """The agreed failures plus this rank's own failure, if any (ERR-3)."""
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
    return FailureReport(step or str(state.phase), dict(sorted(failures.items())), committed)


def _action(row: Row, state: State) -> Action:
    """The row's action; a held failure rides in place of the payload (PROTO-4)."""
    if row.kind is Kind.RAISE:
        return Action(Kind.RAISE, row.next, error=merged_error(state))
    failure = state.failure if row.kind in FAN_IN else None
    error = None
    if row.kind in FAN_OUT and state.coordinator and (state.failure or state.error):
        error = merged_error(state)
    return Action(row.kind, row.next, row.step, row.send, row.recv, failure=failure, error=error)
