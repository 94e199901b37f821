"""Checks, their results, and the ``spec`` decorator that ties each check to a requirement.

Every check cites exactly one requirement of spec/conformance.md (CONF-40);
``refdcp.tools.spec_report`` finds the ``@spec("CONF-N", ...)`` calls statically.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    "backend_error",
    "describe",
    "plain",
    "spec",
    "tick",
]


class CheckFailed(AssertionError):
    """The backend broke the requirement the check cites."""


class NotApplicable(Exception):
    """The check does not apply to this backend; the message says why (CONF-41)."""


def backend_error(exc: BaseException) -> bool:
    """True for anything backend code may raise, ``BaseException`` subclasses such as
    torch's ``CheckpointException`` included; False for the suite's own verdicts and
    ``KeyboardInterrupt`` (CONF-50)."""
    return not isinstance(exc, (KeyboardInterrupt, CheckFailed, NotApplicable))


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def plain(text: str) -> str:
    """``text`` without ANSI colour codes (CONF-54)."""
    return _ANSI.sub("", text)


def describe(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` of an exception, plain and shortened, for a reason (CONF-52)."""
    text = plain(str(exc)).strip()
    if len(text) > limit:
        text = text[:limit] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Context:
    """What a check receives: the backend, scratch space and sizes."""

    backend: Backend
    root: Path
    examples: int = 10
    _n: int = 0
    notes: list[str] = field(default_factory=list)  # shown as a passing check's reason (CONF-69)

    def location(self) -> Any:
        """A fresh checkpoint location of the backend."""
        return self.location_in_scratch()[0]

    def location_in_scratch(self) -> tuple[Any, Path]:
        """A fresh checkpoint location and the scratch directory it was made in."""
        self._n += 1
        scratch = self.root / f"loc{self._n}"
        scratch.mkdir()
        return self.backend.new_location(scratch), scratch


@contextmanager
def context(backend: Backend, examples: int = 10) -> Iterator[Context]:
    root = Path(tempfile.mkdtemp(prefix="refdcp-conf-"))
    try:
        yield Context(backend, root, examples)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Progress:
    """When the check running in a thread last saw the backend move: its watchdog (CONF-51)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()


_local = threading.local()
_current: list[Progress] = []


def watch(progress: Progress) -> None:
    """Make ``progress`` the clock that :func:`tick` moves, for this thread and for
    threads a check starts (which have no clock of their own)."""
    _local.progress = progress
    _current[:] = [progress]


def tick() -> None:
    """A call into the backend started or returned: the running check made progress."""
    progress = getattr(_local, "progress", None) or (_current[0] if _current else None)
    if progress is not None:
        progress.tick()


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
    timed_out: bool = False  # the check was abandoned after the per-check timeout (CONF-51)


CHECKS: list[Check] = []


def spec(req_id: str, *, title: str, needs: tuple[str, ...] = ()) -> Callable[[CheckFn], CheckFn]:
    """Register the decorated function as a check of requirement ``req_id``.

    Only the ID is positional, so ``refdcp.tools.spec_report`` reads it as a citation.
    """

    def register(fn: CheckFn) -> CheckFn:
        CHECKS.append(Check(req_id, title, needs, fn))
        return fn

    return register
