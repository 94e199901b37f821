"""Single-row mutants of a protocol table, judged by the model checker (MODEL-7).

Each mutant changes one field of one row: its next phase, its role, its event,
its effect (action kind, step and slots), or whether it passes the commit point.
A mutant is *killed* when the table refuses it (two rows for one key, a
malformed row) or the model checker finds a violation; a mutant the checker
cannot tell from the original is *equivalent* and must be listed, with its
reason, in :data:`EQUIVALENT`. Pure: no clock, no I/O (PROTO-9).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from refdcp.protocol.machine import Kind, On, Role, Row, Table
from refdcp.protocol.model import Config, explore
from refdcp.protocol.names import Slot, Step

__all__ = ["EQUIVALENT", "Mutant", "judge", "mutants"]


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


#: Mutants no run can tell from the original, and why: (table, row index, change) -> reason.
EQUIVALENT: dict[tuple[str, int, str], str] = {}

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
