"""Marking an exception from ``StorageWriter.finish`` with the commit status it leaves (SAVE-16).

A writer whose ``finish`` raises tells the protocol whether it had passed its
commit point: ``mark(exc, True)`` after the point (for example when the
directory fsync after the rename fails), ``mark(exc, False)`` before it. An
exception without a mark counts as "unknown" (``committed=None``).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["COMMIT_ATTR", "MISSING", "declared", "mark"]

#: The attribute set on the exception: True, False, or None (unknown).
COMMIT_ATTR = "refdcp_committed"

#: What :func:`declared` returns for an exception without a mark.
MISSING: Any = object()


def mark(exc: BaseException, committed: bool | None) -> None:
    """Record on ``exc`` whether the commit point had been passed when it was raised."""
    with contextlib.suppress(AttributeError, TypeError):  # a type that takes no attributes
        setattr(exc, COMMIT_ATTR, committed)


def declared(exc: BaseException) -> Any:
    """The status recorded on ``exc``, or :data:`MISSING`."""
    return getattr(exc, COMMIT_ATTR, MISSING)
