"""Deterministic simulator: N rank machines in one thread, with fault injection (PROTO-7).

Every rank runs its local steps in rank order; when all live ranks wait at a
collective it is resolved at once. A rank that waits at a collective while
another rank has finished, or ranks that wait at different collectives, are
exactly the situations that hang a real process group: the simulator reports
them as :class:`Deadlock` instead (PROTO-5).

A :class:`Fault` raises an exception on one rank *before* its action number
``index`` (0-based); ``index`` equal to the number of actions the rank takes
means "after its last action". This enumerates every point of a protocol run.
The fault becomes the machine's ``err`` event; its table says what follows.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refdcp.driver.run import (
    Observer,
    StepRecord,
    _Ctx,
    apply_collective_result,
    fault_event,
    local_event,
    record,
    send_value,
    terminal,
)
from refdcp.errors import CheckpointError, CommAborted, Deadlock, InjectedFault
from refdcp.protocol.machine import COLLECTIVES, TERMINAL, Action, Event, Kind, State, Table
from refdcp.protocol.outcomes import comm_failure

__all__ = ["Deadlock", "Fault", "InjectedFault", "SimResult", "simulate"]


@dataclass(frozen=True)
class Fault:
    """``exc`` raised on ``rank`` before its action ``index``.

    With ``dies=True`` the rank dies there instead (a killed process): it
    takes no further action, and every rank waiting at a collective gets the
    communicator's failure naming it (SAVE-15, COMM-61).
    """

    rank: int
    index: int
    exc: BaseException = field(default_factory=lambda: InjectedFault("injected fault"))
    dies: bool = False


@dataclass
class SimResult:
    """Per-rank outcomes: ``results[r]`` is the return value or the raised exception."""

    results: list[Any]
    actions: list[list[Action]]
    records: list[StepRecord]

    def errors(self) -> dict[int, BaseException]:
        return {r: v for r, v in enumerate(self.results) if isinstance(v, BaseException)}


@dataclass
class _Rank:
    ctx: _Ctx
    state: State
    action: Action
    index: int = 0
    done: bool = False
    dead: bool = False
    result: Any = None
    log: list[Action] = field(default_factory=list)


def simulate(
    table: Table,
    contexts: Sequence[_Ctx],
    *,
    coordinator_rank: int = 0,
    fault: Fault | None = None,
    observer: Observer | None = None,
) -> SimResult:
    """Run ``len(contexts)`` ranks of ``table`` to completion in this thread."""
    world = len(contexts)
    records: list[StepRecord] = []

    def observe(rec: StepRecord) -> None:
        records.append(rec)
        if observer is not None:
            observer(rec)

    ranks = []
    for r, ctx in enumerate(contexts):
        state, action = table.start(r, r == coordinator_rank)
        ranks.append(_Rank(ctx, state, action))

    def feed(rk: _Rank, event: Event, seconds: float = 0.0) -> None:
        observe(record(rk.state, rk.index, rk.action, event.on, seconds))
        rk.log.append(rk.action)
        rk.index += 1
        rk.state, rk.action = table.transition(rk.state, event)

    def advance(rk: _Rank) -> None:
        while not rk.done:
            a = rk.action
            if fault is not None and (fault.rank, fault.index) == (rk.state.rank, rk.index):
                if fault.dies:  # a killed process: it takes no further action
                    rk.done, rk.dead, rk.result = True, True, fault.exc
                    return
                feed(rk, fault_event(rk.state.rank, a, fault.exc))  # the table decides (PROTO-7)
                continue
            if a.kind in TERMINAL:
                rk.done = True
                rk.result = terminal(rk.ctx, a)
                rk.log.append(a)
                return
            if a.kind in COLLECTIVES:
                return
            feed(rk, local_event(rk.ctx, a))

    while True:
        for rk in ranks:
            advance(rk)
        waiting = [rk for rk in ranks if not rk.done]
        if not waiting:
            break
        dead = [rk.state.rank for rk in ranks if rk.dead]
        if dead:  # a real communicator fails the collective, naming the dead ranks
            for rk in waiting:
                exc = CommAborted(f"rank(s) {dead} died before joining {str(rk.action.phase)!r}")
                exc.ranks = tuple(dead)
                rk.result = CheckpointError.from_report(
                    comm_failure(table, rk.state, rk.action, rk.state.rank, coordinator_rank, exc)
                )
                rk.done = True
                rk.log.append(rk.action)
            break
        finished = [rk.state.rank for rk in ranks if rk.done]
        if finished:
            raise Deadlock(
                f"ranks {[rk.state.rank for rk in waiting]} wait in {waiting[0].action.phase!r} "
                f"while ranks {finished} have finished: a real process group would hang"
            )
        shapes = {(rk.action.kind, rk.action.phase) for rk in waiting}
        if len(shapes) != 1:
            raise Deadlock(f"ranks wait in different collectives: {sorted(str(s) for s in shapes)}")
        _resolve(ranks, world, coordinator_rank, feed)

    return SimResult([rk.result for rk in ranks], [rk.log for rk in ranks], records)


def _resolve(ranks: list[_Rank], world: int, coord: int, feed: Any) -> None:
    kind = ranks[0].action.kind
    if kind in (Kind.GATHER, Kind.ALL_GATHER):
        sent = pickle.dumps([send_value(rk.ctx, rk.action, world) for rk in ranks])
        for rk in ranks:
            receives = kind is Kind.ALL_GATHER or rk.state.rank == coord
            got = pickle.loads(sent) if receives else None
            feed(rk, apply_collective_result(rk.ctx, rk.state, rk.action, got, receives))
        return
    root = ranks[coord]
    out = pickle.dumps(send_value(root.ctx, root.action, world))
    for rk in ranks:
        value = pickle.loads(out)
        value = value[rk.state.rank] if kind is Kind.SCATTER else value
        feed(rk, apply_collective_result(rk.ctx, rk.state, rk.action, value, True))
