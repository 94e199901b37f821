"""Checks, their results, and the ``spec`` decorator that ties each check to a requirement.

Every check cites exactly one requirement of spec/conformance.md (CONF-40);
``refdcp.tools.spec_report`` finds the ``@spec("CONF-N", ...)`` calls statically.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.backend import Backend

__all__ = [
    "CHECKS",
    "Check",
    "CheckFailed",
    "Context",
    "NotApplicable",
    "Result",
    "spec",
]


class CheckFailed(AssertionError):
    """The backend broke the requirement the check cites."""


class NotApplicable(Exception):
    """The check does not apply to this backend; the message says why (CONF-41)."""


@dataclass
class Context:
    """What a check receives: the backend, scratch space and sizes."""

    backend: Backend
    root: Path
    examples: int = 10
    _n: int = 0

    def location(self) -> Any:
        """A fresh checkpoint location of the backend."""
        self._n += 1
        scratch = self.root / f"loc{self._n}"
        scratch.mkdir()
        return self.backend.new_location(scratch)


@contextmanager
def context(backend: Backend, examples: int = 10) -> Iterator[Context]:
    root = Path(tempfile.mkdtemp(prefix="refdcp-conf-"))
    try:
        yield Context(backend, root, examples)
    finally:
        shutil.rmtree(root, ignore_errors=True)


CheckFn = Callable[[Context], None]


@dataclass(frozen=True)
class Check:
    """One check: the requirement it cites, a title, and the capabilities it needs."""

    id: str
    title: str
    needs: tuple[str, ...]
    fn: CheckFn


@dataclass(frozen=True)
class Result:
    """The outcome of one check on one backend."""

    id: str
    level: str
    title: str
    status: str  # "pass" | "fail" | "n/a"
    reason: str
    seconds: float


CHECKS: list[Check] = []


def spec(req_id: str, *, title: str, needs: tuple[str, ...] = ()) -> Callable[[CheckFn], CheckFn]:
    """Register the decorated function as a check of requirement ``req_id``.

    Only the ID is positional, so ``refdcp.tools.spec_report`` reads it as a citation.
    """

    def register(fn: CheckFn) -> CheckFn:
        CHECKS.append(Check(req_id, title, needs, fn))
        return fn

    return register
