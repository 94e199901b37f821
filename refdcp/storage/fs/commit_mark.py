"""Marking an exception from ``StorageWriter.finish`` with the commit status it leaves (SAVE-16).

A writer whose ``finish`` raises tells the protocol whether it had passed its
commit point: ``mark(exc, True)`` after the point (for example when the
directory fsync after the rename fails), ``mark(exc, False)`` before it. An
exception without a mark counts as "unknown" (``committed=None``). The rule
and its functions live in the protocol (``refdcp/protocol/outcomes.py``); this
is the path writers import them from.
"""

from __future__ import annotations

from refdcp.protocol.outcomes import COMMIT_ATTR, MISSING, declared, mark

__all__ = ["COMMIT_ATTR", "MISSING", "declared", "mark"]
