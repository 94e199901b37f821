"""Mermaid state diagrams generated from the transition tables (PROTO-8).

``python -m refdcp.tools.diagrams`` rewrites ``spec/diagrams.md``; a test
fails when the committed file differs from what the tables generate.
"""

from __future__ import annotations

import sys
from pathlib import Path

from refdcp.protocol.load import LOAD
from refdcp.protocol.machine import IDLE, Kind, Role, Table
from refdcp.protocol.save import SAVE

__all__ = ["mermaid", "render_all", "main"]

_HEADER = """# Protocol state diagrams

Generated from the transition tables in `refdcp/protocol/` by
`python -m refdcp.tools.diagrams`; do not edit by hand (PROTO-8).
Edge labels read `event [role] / action`. `err` self-loops on collective
phases mean: a rank that fails before a collective still joins it, sending
its failure instead of its payload (PROTO-5).
"""


def _node(phase: str) -> str:
    if phase == IDLE:
        return "[*]"
    if phase in ("done", "failed"):
        return phase
    return phase


def mermaid(table: Table) -> str:
    lines = ["stateDiagram-v2"]
    for row in table.rows:
        role = "" if row.role is Role.ANY else f" [{row.role.value}]"
        if row.kind is Kind.LOCAL:
            act = f"call {row.step}"
        elif row.kind in (Kind.RETURN, Kind.RAISE):
            act = row.kind.value
        else:
            act = f"{row.kind.value} {row.step}"
        commit = " (COMMIT POINT)" if row.commits and row.kind is Kind.BROADCAST else ""
        lines.append(
            f"    {_node(row.phase)} --> {_node(row.next)}: {row.on.value}{role} / {act}{commit}"
        )
    lines.append("    done --> [*]")
    lines.append("    failed --> [*]")
    return "\n".join(lines)


def render_all() -> str:
    parts = [_HEADER]
    for title, table in (("Save", SAVE), ("Load", LOAD)):
        parts.append(f"## {title}\n\n```mermaid\n{mermaid(table)}\n```\n")
    return "\n".join(parts)


def diagrams_path() -> Path:
    return Path(__file__).resolve().parents[2] / "spec" / "diagrams.md"


def main(argv: list[str] | None = None) -> int:
    diagrams_path().write_text(render_all(), encoding="utf-8")
    print(f"wrote {diagrams_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
