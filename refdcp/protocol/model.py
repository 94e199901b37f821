"""An explicit-state model checker over the real protocol tables (MODEL-1..MODEL-6).

N copies of one table (``SAVE`` or ``LOAD``, the objects the drivers run) are
composed with the collectives' semantics and the real failure decisions of
``protocol/outcomes.py``. Every local step is abstracted to its outcomes, and
a breadth-first search explores every interleaving of the ranks and every
placement of up to K faults of these kinds (:data:`FAULT_KINDS`):

* ``raise``: a fault hook raises before any action of a rank (a local step
  that raises is the same ``err`` event, PROTO-7);
* ``lose``: a rank is lost before an action: it never acts again, and every
  collective it misses fails on the ranks that wait (COMM-60, COMM-61);
* ``partial``: a collective fails on some ranks only and delivers on the rest;
* ``commit``: ``StorageWriter.finish`` raises, before its durable point
  (declaring ``False``), after it (declaring ``True``), or declaring nothing
  (SAVE-16);
* ``after_last``: a fault after a rank's last action (a ``raise`` in ``done``).

In every reachable state and at every end it checks (spec/protocol.md):
agreement (MODEL-2), commit safety (MODEL-3), liveness (MODEL-4) and that no
rank takes an event its table has no row for (MODEL-5); a violation comes with
the shortest run that reaches it, one line per rank and step, each naming the
row and its requirement (MODEL-6). Pure: no clock, no I/O (PROTO-9).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

from refdcp.errors_core import (
    CommAborted,
    CommError,
    CommTimeout,
    Failure,
    FailureReport,
    ModelFault,
)
from refdcp.errors_core import ProtocolError as _ProtocolError
from refdcp.protocol.machine import (
    COLLECTIVES,
    FAN_IN,
    Action,
    Event,
    Kind,
    On,
    State,
    Table,
)
from refdcp.protocol.names import Phase, Slot, Step
from refdcp.protocol.outcomes import (
    comm_failure,
    delivered,
    finish_failed,
    mark,
    needs_payload,
    outgoing,
)

__all__ = ["FAULT_KINDS", "Config", "ModelFault", "Result", "Violation", "check", "explore"]

#: The invariants a violation names (spec/protocol.md).
INVARIANTS = {
    "MODEL-2": "MODEL-2 agreement",
    "MODEL-3": "MODEL-3 commit safety",
    "MODEL-4": "MODEL-4 liveness",
    "MODEL-5": "MODEL-5 no missing row or slot",
}

#: Every kind of fault the checker places (MODEL-1).
FAULT_KINDS = frozenset({"raise", "lose", "partial", "commit", "after_last"})


#: What each local step reads and fills (the step bodies' contract, PROTO-10, PROTO-11):
#: (table, step) -> (slots it needs, slots it fills).
STEP_SLOTS: dict[tuple[str, Step], tuple[frozenset[Slot], frozenset[Slot]]] = {
    (t, step): (frozenset(needs), frozenset(makes))
    for t, step, needs, makes in (
        ("save", Step.SET_UP, (), (Slot.FLAT_STATE_DICT,)),
        ("save", Step.LOCAL_PLAN, (Slot.FLAT_STATE_DICT,), (Slot.LOCAL_PLAN,)),
        ("save", Step.GLOBAL_PLAN, (Slot.ALL_PLANS,), (Slot.GLOBAL_PLANS, Slot.METADATA)),
        ("save", Step.FINISH_PLAN, (Slot.CENTRAL_PLAN,), (Slot.FINAL_PLAN,)),
        ("save", Step.WRITE, (Slot.FINAL_PLAN,), (Slot.WRITE_RESULTS,)),
        ("save", Step.COMMIT, (Slot.ALL_RESULTS, Slot.METADATA), ()),
        ("load", Step.SET_UP, (), (Slot.FLAT_STATE_DICT, Slot.METADATA)),
        ("load", Step.LOCAL_PLAN, (Slot.FLAT_STATE_DICT,), (Slot.LOCAL_PLAN,)),
        ("load", Step.GLOBAL_PLAN, (Slot.ALL_PLANS,), (Slot.GLOBAL_PLANS,)),
        ("load", Step.FINISH_PLAN, (Slot.CENTRAL_PLAN,), (Slot.FINAL_PLAN,)),
        ("load", Step.READ, (Slot.FINAL_PLAN,), (Slot.READ_OUTCOME,)),
        ("load", Step.APPLY, (Slot.READ_OUTCOMES, Slot.FLAT_STATE_DICT), (Slot.APPLY_OUTCOME,)),
    )
}


@dataclass(frozen=True)
class Config:
    """What to explore: ``world`` copies of ``table`` with up to ``max_faults`` faults (MODEL-1)."""

    table: Table
    world: int
    max_faults: int
    kinds: frozenset[str] = FAULT_KINDS


@dataclass(frozen=True)
class _Rank:
    state: State
    action: Action
    status: str = "run"  # run | ended | dead
    outcome: tuple[Any, ...] | None = None
    via: str = "protocol"  # how it ended: protocol | comm | after_last
    late: bool = False  # its own failure came after its last fan-in collective
    slots: frozenset[Slot] = frozenset()  # the context slots its steps and collectives filled
    ran: frozenset[Step] = frozenset()  # the local steps it has run


@dataclass(frozen=True)
class _World:
    ranks: tuple[_Rank, ...]
    faults: int = 0
    finish_calls: int = 0
    durable: bool = False
    undeclared: bool = False  # a finish raised declaring nothing
    wrote: frozenset[int] = frozenset()  # ranks whose write returned
    read: frozenset[int] = frozenset()  # ranks whose read returned
    steps: int = 0


@dataclass(frozen=True)
class Violation:
    """A broken invariant and the shortest run that reaches it (MODEL-6)."""

    invariant: str
    detail: str
    trace: tuple[tuple[int, str], ...]

    def table(self, world: int) -> str:
        """The run as one column per rank, one line per step."""
        width = 58
        head = " | ".join(f"rank {r}".ljust(width) for r in range(world))
        lines = [f"{self.invariant}: {self.detail}", head, "-" * len(head)]
        for rank, text in self.trace:
            cells = [""] * world
            if rank < 0:
                cells = [text[:width]] * world
            else:
                cells[rank] = text[:width]
            lines.append(" | ".join(c.ljust(width) for c in cells))
        return "\n".join(lines)


@dataclass
class Result:
    """What an exploration found: states seen, ends reached, and violations (MODEL-6)."""

    config: Config
    states: int = 0
    ends: int = 0
    violations: list[Violation] = field(default_factory=list)


# -- canonical keys (a state's meaning without exception objects or dicts) -------------------


def _failure_key(f: Failure | None) -> Any:
    return None if f is None else (f.rank, f.step, type(f.exception).__name__)


def _report_key(r: FailureReport | None) -> Any:
    if r is None:
        return None
    return (
        r.step,
        tuple(sorted((k, _failure_key(v)) for k, v in r.rank_failures.items())),
        r.committed,
    )


def _rank_key(rk: _Rank) -> Any:
    s, a = rk.state, rk.action
    return (
        s.phase, s.coordinator, _failure_key(s.failure), _report_key(s.error), s.committed,
        a.kind, a.phase, a.step, _failure_key(a.failure), _report_key(a.error),
        rk.status, rk.outcome, rk.via, rk.slots, rk.ran,
    )  # fmt: skip


def _key(w: _World) -> Any:
    return (
        tuple(_rank_key(r) for r in w.ranks),
        w.faults, w.finish_calls, w.durable, w.undeclared, w.wrote, w.read,
    )  # fmt: skip


# -- one rank's moves ---------------------------------------------------------------------------


def _put(w: _World, r: int, rank: _Rank) -> tuple[_Rank, ...]:
    """The ranks of ``w`` with rank ``r`` replaced."""
    ranks = list(w.ranks)
    ranks[r] = rank
    return tuple(ranks)


def _outcome(report: FailureReport) -> tuple[Any, ...]:
    return ("raise", report.step, tuple(sorted(report.rank_failures)), report.committed)


def _feed(
    cfg: Config,
    w: _World,
    r: int,
    event: Event,
    via: str = "protocol",
    fill: frozenset[Slot] = frozenset(),
    ran: Step | None = None,
) -> tuple[_World, str]:
    """Rank ``r`` takes ``event`` (its step or collective filled ``fill``); its next
    action is done at once if terminal."""
    rk = w.ranks[r]
    row = cfg.table.lookup(rk.state.phase, event.on, rk.state.coordinator)
    state, action = cfg.table.transition(rk.state, event)
    label = f"{rk.state.phase} --{event.on.value}--> {state.phase} [{row.req}]"
    new = replace(
        rk, state=state, action=action, slots=rk.slots | fill,
        ran=rk.ran | ({ran} if ran is not None else set()),
    )  # fmt: skip
    via = "after_last" if rk.late else via
    if action.kind is Kind.RETURN and action.send is not None and action.send not in new.slots:
        return w, f"VIOLATION MODEL-5|rank {r} returns slot {action.send!s}, which nothing filled"
    if action.kind is Kind.RETURN:
        new = replace(new, status="ended", outcome=("ok",), via=via)
    elif action.kind is Kind.RAISE:
        assert action.error is not None
        new = replace(new, status="ended", outcome=_outcome(action.error), via=via)
    ranks = _put(w, r, new)
    return replace(w, ranks=ranks, steps=w.steps + 1), label


def _err(rank: int, step: str, exc: BaseException | None = None) -> Event:
    return Event(On.ERR, failure=Failure(rank, step, exc or ModelFault("injected"), ""))


def _local(cfg: Config, w: _World, r: int) -> Iterator[tuple[_World, str]]:
    rk = w.ranks[r]
    step = rk.action.step
    assert step is not None
    needs, makes = STEP_SLOTS.get((cfg.table.name, step), (frozenset(), frozenset()))
    if step in rk.ran:
        yield w, f"VIOLATION MODEL-5|rank {r} runs {step!s} a second time"
        return
    if not needs <= rk.slots:
        missing = sorted(map(str, needs - rk.slots))
        yield w, f"VIOLATION MODEL-5|rank {r} runs {step!s} without {missing} (PROTO-11)"
        return
    if step is Step.COMMIT:
        if w.finish_calls >= 1:
            yield w, "VIOLATION MODEL-3|finish called twice"
            return
        calls = w.finish_calls + 1
        if cfg.world > len(w.wrote):
            yield (
                w,
                f"VIOLATION MODEL-3|finish called before every write returned (wrote {sorted(w.wrote)})",
            )
            return
        ok = replace(w, finish_calls=calls, durable=True)
        yield _feed(cfg, ok, r, Event(On.OK), ran=step)
        if w.faults < cfg.max_faults and "commit" in cfg.kinds:
            for declared, durable in ((False, False), (True, True), (None, True), (None, False)):
                exc = ModelFault("finish raised")
                if declared is not None:
                    mark(exc, declared)
                finish_failed(exc)
                bad = replace(
                    w, finish_calls=calls, durable=durable, faults=w.faults + 1,
                    undeclared=w.undeclared or declared is None,
                )  # fmt: skip
                nw, label = _feed(cfg, bad, r, _err(r, str(step), exc), ran=step)
                yield nw, f"{label} (finish raised, declared {declared}, durable {durable})"
        return
    if step is Step.APPLY and len(w.read) < cfg.world:
        yield w, f"VIOLATION MODEL-3|apply before every read returned (read {sorted(w.read)})"
        return
    done = w
    if step is Step.WRITE:
        done = replace(w, wrote=w.wrote | {r})
    elif step is Step.READ:
        done = replace(w, read=w.read | {r})
    yield _feed(cfg, done, r, Event(On.OK), fill=makes, ran=step)


def _rank_moves(cfg: Config, w: _World, r: int) -> Iterator[tuple[_World, str]]:
    rk = w.ranks[r]
    if rk.status != "run":
        return
    can_fault = w.faults < cfg.max_faults and rk.state.failure is None
    if w.faults < cfg.max_faults and "lose" in cfg.kinds:  # a process dies, failed or not
        ranks = _put(w, r, replace(rk, status="dead"))
        yield replace(w, ranks=ranks, faults=w.faults + 1, steps=w.steps + 1), "LOST"
    if can_fault and "raise" in cfg.kinds:
        name = str(rk.action.step or rk.action.phase)
        if rk.state.phase in _unheard(cfg.table, rk.state.coordinator):
            rk = replace(rk, late=True)
            w = replace(w, ranks=_put(w, r, rk))
        nw, label = _feed(cfg, replace(w, faults=w.faults + 1), r, _err(r, name))
        yield nw, f"{label} (fault before {rk.action.kind.value})"
    if rk.action.kind is Kind.LOCAL:
        yield from _local(cfg, w, r)


def _unheard(table: Table, coordinator: bool) -> frozenset[Phase]:
    """Phases from which no collective carries this rank's failure to the others.

    A peer's failure travels only at a fan-in collective; the coordinator's at
    any collective. A rank that fails in such a phase raises alone (PROTO-13,
    MODEL-2): for a save, a peer that fails before or during the outcome
    broadcast, or any rank after its last action.
    """
    cached = _UNHEARD.get((table.name, coordinator))
    if cached is not None and cached[0] is table:
        return cached[1]
    kinds = COLLECTIVES if coordinator else FAN_IN
    reach: dict[Phase, set[Phase]] = {}
    for row in table.rows:
        reach.setdefault(row.phase, set()).add(row.next)
    carriers = {row.next for row in table.rows if row.kind in kinds}
    out = set()
    for phase in table.phases:
        seen, todo = set(), [phase]
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo.extend(reach.get(p, ()))
        if not seen & carriers:
            out.add(phase)
    result = frozenset(out)
    _UNHEARD[(table.name, coordinator)] = (table, result)
    return result


_UNHEARD: dict[tuple[str, bool], tuple[Table, frozenset[Phase]]] = {}


def _after_last(cfg: Config, w: _World, r: int) -> Iterator[tuple[_World, str]]:
    """A fault before rank ``r``'s terminal action: after its last action (``done --err-->
    failed``), or on a rank about to raise the agreed failures (``failed --err--> failed``,
    its own failure joins them) (PROTO-7, PROTO-13)."""
    rk = w.ranks[r]
    if not (
        rk.status == "ended" and rk.via == "protocol" and rk.state.failure is None
        and "after_last" in cfg.kinds and w.faults < cfg.max_faults
    ):  # fmt: skip
        return
    back = replace(rk, status="run")
    w2 = replace(w, ranks=_put(w, r, back), faults=w.faults + 1)
    nw, label = _feed(cfg, w2, r, _err(r, str(rk.state.phase)), via="after_last")
    yield nw, f"{label} (fault before the terminal action)"


# -- collectives --------------------------------------------------------------------------------


def _comm_end(cfg: Config, w: _World, r: int, exc: CommError) -> tuple[_World, str]:
    rk = w.ranks[r]
    report = comm_failure(cfg.table, rk.state, rk.action, r, 0, exc)
    new = replace(rk, status="ended", outcome=_outcome(report), via="comm")
    ranks = _put(w, r, new)
    return replace(w, ranks=ranks), f"{rk.action.phase}: {type(exc).__name__} -> raise"


def _collective(cfg: Config, w: _World) -> Iterator[tuple[_World, list[tuple[int, str]]]]:
    waiting = [r for r, rk in enumerate(w.ranks) if rk.status == "run"]
    if not waiting or any(w.ranks[r].action.kind not in COLLECTIVES for r in waiting):
        return
    missing = tuple(r for r, rk in enumerate(w.ranks) if rk.status != "run")
    skipped = [r for r in missing if w.ranks[r].via != "comm" and w.ranks[r].status == "ended"]
    if skipped:  # no fault made it leave: it skipped a collective its peers joined (PROTO-5)
        where = w.ranks[waiting[0]].action.phase
        text = f"VIOLATION MODEL-4|rank {skipped[0]} ended while rank {waiting[0]} waits at {where}"
        yield w, [(-1, text)]
        return
    if missing:  # a rank that left never joins: the waiting ranks time out (COMM-60)
        exc: CommError = CommAborted(f"rank(s) {list(missing)} did not join")
        exc.ranks = missing
        labels = []
        for r in waiting:
            w, text = _comm_end(cfg, w, r, exc)
            labels.append((r, text))
        yield w, labels
        return
    shapes = {(w.ranks[r].action.kind, w.ranks[r].action.phase) for r in waiting}
    if len(shapes) > 1:
        yield (
            w,
            [
                (
                    -1,
                    f"VIOLATION MODEL-4|ranks wait in different collectives: {sorted(map(str, shapes))}",
                )
            ],
        )
        return
    yield _deliver(cfg, w, frozenset())
    if w.faults < cfg.max_faults and "partial" in cfg.kinds and cfg.world > 1:
        for n in range(1, cfg.world):
            for failing in combinations(range(cfg.world), n):
                yield _deliver(cfg, replace(w, faults=w.faults + 1), frozenset(failing))


def _deliver(
    cfg: Config, w: _World, failing: frozenset[int]
) -> tuple[_World, list[tuple[int, str]]]:
    """Complete the collective every rank waits at; it fails on the ``failing`` ranks only."""
    world = cfg.world
    acts = [rk.action for rk in w.ranks]
    kind = acts[0].kind
    payload = [("plan", r) for r in range(world)] if kind is Kind.SCATTER else ("payload", 0)
    sent = [outgoing(a, world, payload if r == 0 else ("payload", r)) for r, a in enumerate(acts)]
    labels: list[tuple[int, str]] = []
    for r, a in enumerate(acts):
        sends = kind in FAN_IN or w.ranks[r].state.coordinator
        if sends and needs_payload(a) and a.send is not None and a.send not in w.ranks[r].slots:
            text = f"VIOLATION MODEL-5|rank {r} sends slot {a.send!s}, which nothing filled"
            return w, [(r, text)]
    for r in range(world):
        if r in failing:
            w, text = _comm_end(cfg, w, r, CommTimeout("timed out on this rank only"))
            labels.append((r, text))
            continue
        coordinator = w.ranks[r].state.coordinator
        if kind in FAN_IN:
            receives = kind is Kind.ALL_GATHER or coordinator
            received: Any = list(sent) if receives else None
        else:
            receives = True
            root = sent[0]
            received = root[r] if kind is Kind.SCATTER else root
        event, _ = delivered(w.ranks[r].state, acts[r], received, receives)
        recv = acts[r].recv
        got: frozenset[Slot] = frozenset()
        if event.on is On.GOT_OK and recv is not None:
            got = frozenset({recv})
        w, text = _feed(cfg, w, r, event, fill=got)
        labels.append((r, text))
    return w, labels


# -- invariants ---------------------------------------------------------------------------------


def _end_problems(cfg: Config, w: _World) -> list[tuple[str, str]]:
    """Agreement and commit safety at an end where no rank runs (MODEL-2, MODEL-3)."""
    out: list[tuple[str, str]] = []
    ended = [(r, rk) for r, rk in enumerate(w.ranks) if rk.status == "ended"]
    if w.faults == 0 and any(rk.outcome != ("ok",) or rk.via != "protocol" for _, rk in ended):
        out.append(("MODEL-2 agreement", "a run without faults does not return on every rank"))
    heard = [(r, rk.outcome) for r, rk in ended if rk.via == "protocol"]
    kinds = {o[0] for _, o in heard if o is not None}
    if len(kinds) > 1:
        out.append(("MODEL-2 agreement", f"some ranks return, others raise: {heard}"))
    elif kinds == {"raise"}:
        # the agreed report, plus at most each rank's own failure that no peer could hear (ERR-3)
        shapes = {(o[1], o[3]) for _, o in heard if o is not None}
        sets = [(r, set(o[2])) for r, o in heard if o is not None]
        common = set.intersection(*(s for _, s in sets))
        if len(shapes) > 1 or not common or any(not s <= common | {r} for r, s in sets):
            out.append(("MODEL-2 agreement", f"the ranks' reports differ: {heard}"))
    saves = cfg.table.name == "save"
    for r, rk in ended:
        assert rk.outcome is not None
        if rk.outcome == ("ok",):
            if saves and not w.durable:
                out.append(
                    ("MODEL-3 commit safety", f"rank {r} returned but nothing was committed")
                )
            continue
        committed = rk.outcome[3]
        if not saves and committed is not False:
            out.append(("MODEL-3 commit safety", f"rank {r}: a load reports committed={committed}"))
        elif committed is True and not w.durable:
            out.append(("MODEL-3 commit safety", f"rank {r} reports committed=True, not durable"))
        elif committed is False and w.durable:
            out.append(("MODEL-3 commit safety", f"rank {r} reports committed=False, but it is"))
        elif committed is None and rk.state.coordinator and not w.undeclared:
            out.append(("MODEL-3 commit safety", f"coordinator {r} reports unknown, but it knows"))
        elif committed is None and rk.via == "protocol" and not w.undeclared:
            out.append(("MODEL-3 commit safety", f"rank {r} reports unknown through the protocol"))
    return out


def _successors(cfg: Config, w: _World) -> Iterator[tuple[_World, list[tuple[int, str]]]]:
    for r in range(cfg.world):
        for nw, label in _rank_moves(cfg, w, r):
            yield nw, [(r, label)]
        for nw, label in _after_last(cfg, w, r):
            yield nw, [(r, label)]
    yield from _collective(cfg, w)


def _start(cfg: Config) -> _World:
    ranks = []
    for r in range(cfg.world):
        state, action = cfg.table.start(r, r == 0)
        ranks.append(_Rank(state, action))
    return _World(tuple(ranks))


def _bound(cfg: Config) -> int:
    """Steps within which every run ends: every rank once through every row, per fault."""
    return (len(cfg.table.rows) + 2) * cfg.world * (cfg.max_faults + 1) + cfg.world


def explore(cfg: Config, *, stop_at_first: bool = True) -> Result:
    """Breadth-first search of every run of ``cfg`` (MODEL-1); shortest counterexamples first."""
    result = Result(cfg)
    try:
        start = _start(cfg)
    except _ProtocolError as exc:
        result.violations.append(Violation(INVARIANTS["MODEL-5"], str(exc), ()))
        return result
    parents: dict[Any, tuple[Any, tuple[tuple[int, str], ...]] | None] = {_key(start): None}
    queue: deque[_World] = deque([start])
    bound = _bound(cfg)

    def trace(key: Any, last: Iterable[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
        steps: list[tuple[int, str]] = list(last)
        while (entry := parents[key]) is not None:
            key, labels = entry
            steps[:0] = labels
        return tuple(steps)

    def fail(invariant: str, detail: str, key: Any, last: Iterable[tuple[int, str]]) -> bool:
        result.violations.append(Violation(invariant, detail, trace(key, last)))
        return stop_at_first

    while queue:
        w = queue.popleft()
        key = _key(w)
        if w.steps > bound:
            if fail("MODEL-4 liveness", f"a run is longer than the bound {bound}", key, []):
                break
            continue
        moved = False
        try:
            succ = list(_successors(cfg, w))
        except _ProtocolError as exc:
            if fail(INVARIANTS["MODEL-5"], str(exc), key, []):
                break
            continue
        stop = False
        for nw, labels in succ:
            bad = [t for _, t in labels if t.startswith("VIOLATION ")]
            if bad:
                code, _, detail = bad[0][len("VIOLATION ") :].partition("|")
                if fail(INVARIANTS[code], detail, key, labels):
                    stop = True
                    break
                continue
            moved = True
            nkey = _key(nw)
            if nkey not in parents:
                parents[nkey] = (key, tuple(labels))
                queue.append(nw)
        if stop:
            break
        if not moved and any(rk.status == "run" for rk in w.ranks):
            if fail("MODEL-4 liveness", "a rank waits forever", key, []):
                break
            continue
        if all(rk.status != "run" for rk in w.ranks):
            result.ends += 1
            problems = _end_problems(cfg, w)
            if problems and fail(*problems[0], key, []):
                break
    result.states = len(parents)
    return result


def check(table: Table, worlds: Iterable[int], max_faults: int, **kw: Any) -> list[Result]:
    """:func:`explore` every world size in ``worlds`` (MODEL-1)."""
    return [explore(Config(table, n, max_faults, **kw)) for n in worlds]
