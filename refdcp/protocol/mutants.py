"""Single-row mutants of a protocol table, judged by the model checker (MODEL-7).

Each mutant changes one field of one row: its next phase, its role, its event,
its effect (action kind, step and slots), or whether it passes the commit point.
A mutant is *killed* when the table refuses it (two rows for one key, a
malformed row) or the model checker finds a violation; a mutant the checker
cannot tell from the original must match a rule of :func:`equivalence`, which
says why no run can. Pure: no clock, no I/O (PROTO-9).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from refdcp.errors_core import ProtocolError
from refdcp.protocol.machine import FAN_IN, FAN_OUT, Kind, On, Role, Row, Table
from refdcp.protocol.model import STEP_SLOTS, Config, explore
from refdcp.protocol.names import Phase, Slot, Step

__all__ = ["Mutant", "equivalence", "judge", "mutants"]


@dataclass(frozen=True)
class Mutant:
    """One row of ``table`` changed: ``index`` names the row, ``change`` what changed."""

    table: str
    index: int
    change: str
    rows: tuple[Row, ...] | None  # None: the table refused the mutant


_Effect = tuple[Kind, Step | None, Slot | None, Slot | None]


def _effects(table: Table) -> list[_Effect]:
    seen: dict[_Effect, None] = {}
    for row in table.rows:
        seen.setdefault((row.kind, row.step, row.send, row.recv))
    return list(seen)


def mutants(table: Table) -> Iterator[Mutant]:
    """Every single-field change of every row of ``table`` (MODEL-7)."""
    effects = _effects(table)
    for i, row in enumerate(table.rows):
        changes: list[tuple[str, dict[str, object]]] = []
        changes += [(f"next={p}", {"next": p}) for p in table.phases if p != row.next]
        changes += [(f"role={r.value}", {"role": r}) for r in Role if r != row.role]
        changes += [(f"on={o.value}", {"on": o}) for o in On if o != row.on]
        for kind, step, send, recv in effects:
            if (kind, step, send, recv) != (row.kind, row.step, row.send, row.recv):
                effect: dict[str, object] = {"kind": kind, "step": step, "send": send, "recv": recv}
                changes.append((f"effect={kind.value}:{step or send}", effect))
        changes.append((f"commits={not row.commits}", {"commits": not row.commits}))
        for change, fields in changes:
            try:
                new = replace(row, **fields)  # type: ignore[arg-type]
                rows = (*table.rows[:i], new, *table.rows[i + 1 :])
                Table(table.name, rows)
            except ValueError:
                yield Mutant(table.name, i, change, None)
                continue
            yield Mutant(table.name, i, change, rows)


def equivalence(original: Table, mutant: Mutant) -> str | None:
    """Why no run can tell ``mutant`` from ``original``, when one of the rules holds (MODEL-7).

    Each rule names a place the machine never reads: what a rank holding a failure
    would run or send (Rule 1 replaces it), the phase a terminal row names, or a
    role that never takes the row's event in its phase.
    """
    if mutant.rows is None:
        return None
    row, new = original.rows[mutant.index], mutant.rows[mutant.index]
    changed = {f for f in ("phase", "on", "role", "next", "kind", "step", "send", "recv", "commits")
               if getattr(row, f) != getattr(new, f)}  # fmt: skip
    if row.on is On.ERR and new.kind in (Kind.LOCAL, Kind.RETURN) and changed <= _EFFECT:
        then = original.lookup(row.next, On.ERR, row.role is Role.COORD)
        if (then.next, then.kind, then.send, then.recv) == (row.next, row.kind, row.send, row.recv):
            return (
                "Rule 1: a rank holding a failure never runs a local step or returns; it takes "
                "the next phase's err row, whose effect is this row's own"
            )
    if row.on is On.ERR and row.kind in FAN_IN and changed <= {"send", "recv"}:
        return (
            "a rank holding a failure sends it in place of the payload, and a fan-in that "
            "carries a failure delivers got_err: the row's slots are never read or filled"
        )
    if row.kind in FAN_IN and changed <= {"send", "recv"} and not _read_by_a_step(original, row):
        return (
            "no step reads the slot this collective fills, and its event depends only on "
            "whether a rank sent a failure: which filled slot it sends is never seen"
        )
    if changed == {"next"} and row.kind in (Kind.RETURN, Kind.RAISE):
        if row.on is On.ERR:
            return (
                "the row ends a rank that holds a failure; no fault hook runs on such a rank "
                "(PROTO-7), so the phase it names is never read"
            )
        old_err = _err_row(original, row.next, row.role)
        new_err = _err_row(original, new.next, row.role)
        if old_err is not None and new_err is not None and _same_end(old_err, new_err):
            return (
                "the row ends the rank; its phase is read only by a fault before the terminal "
                "action, and both phases' err rows raise the same way"
            )
    if changed == {"commits"} and all(r.commits for r in original.rows if r.next == row.phase):
        return (
            "every row into this phase passes the commit point, so the rank has already passed it"
        )
    if changed == {"role"} and not _other_role_takes(original, row):
        return "the other role never takes this event in this phase, so the wider row is never read"
    return None


_EFFECT = {"kind", "step", "send", "recv"}


def _err_row(table: Table, phase: Phase, role: Role) -> Row | None:
    try:
        return table.lookup(phase, On.ERR, role is Role.COORD)
    except ProtocolError:
        return None


def _read_by_a_step(table: Table, row: Row) -> bool:
    """Whether a step of ``table`` (STEP_SLOTS) or a terminal row reads ``row.recv``."""
    steps = any(
        row.recv in needs for (name, _), (needs, _) in STEP_SLOTS.items() if name == table.name
    )
    returned = any(r.kind is Kind.RETURN and r.send == row.recv for r in table.rows)
    sent_on = any(r.kind in FAN_IN | FAN_OUT and r.send == row.recv for r in table.rows)
    return steps or returned or sent_on


def _same_end(a: Row, b: Row) -> bool:
    """Both rows raise, into the same phase, passing the commit point alike."""
    return a.kind is b.kind is Kind.RAISE and a.next == b.next and a.commits == b.commits


def _other_role_takes(table: Table, row: Row) -> bool:
    """Whether a rank of the other role can be in ``row.phase`` and take ``row.on``."""
    if row.role is Role.ANY:
        return True
    other = Role.PEER if row.role is Role.COORD else Role.COORD
    reached = {r.next for r in table.rows if r.role in (other, Role.ANY)} | {Phase.IDLE}
    if row.phase not in reached:
        return False  # only the row's role enters this phase (the global plan, the commit)
    delivers = {r.on for r in table.rows if r.phase == row.phase and r.role in (other, Role.ANY)}
    return row.on in delivers or row.on is On.ERR


#: The configurations a mutant is checked at, smallest first (MODEL-7).
LADDER = ((2, 1), (3, 1), (2, 2), (3, 2))


def judge(mutant: Mutant, original: Table) -> str | None:
    """How ``mutant`` dies ("refused", or the first violated invariant), None if it survives."""
    if mutant.rows is None:
        return "refused by the table"
    table = Table(original.name, mutant.rows)
    for world, faults in LADDER:
        try:
            result = explore(Config(table, world, faults))
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            return f"the machine breaks at N={world}, K={faults}: {type(exc).__name__}"
        if result.violations:
            return f"{result.violations[0].invariant} at N={world}, K={faults}"
    return None
