"""The torch-free half of :mod:`refdcp.errors`: what the pure protocol needs (ERR-6).

Import these names from :mod:`refdcp.errors` (their home, with the whole
hierarchy drawn); they are defined here so that :mod:`refdcp.protocol` can use
them without importing torch (PROTO-1, PROTO-9).
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CommAborted",
    "CommError",
    "CommTimeout",
    "CollectiveMismatch",
    "Failure",
    "FailureReport",
    "ModelFault",
    "PeerLost",
    "ProblemsError",
    "ProtocolError",
    "RefdcpError",
    "commit_status",
    "describe_failures",
]


class RefdcpError(Exception):
    """Base class of refdcp's own errors."""


class ProblemsError(RefdcpError, ValueError):
    """Every problem found at once, one per line after ``headline`` (META-5, POLICY-1).

    Also a ``ValueError`` (what callers caught before ERR-7). Rebuilt from
    ``problems`` when unpickled, so it survives collectives (ERR-3).
    """

    headline = "problems"

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            f"{self.headline} ({len(self.problems)} problem(s)):\n- " + "\n- ".join(self.problems)
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.problems,))


class ProtocolError(RefdcpError):
    """An order violation of the save/load/staging protocol (PROTO-3).

    ``requirement`` is the spec ID that the violation breaks.
    """

    def __init__(self, requirement: str, message: str) -> None:
        super().__init__(f"[{requirement}] {message}")
        self.requirement = requirement
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.requirement, self.message))


class CommError(RefdcpError):
    """A collective could not complete (COMM-5).

    ``ranks`` lists the ranks known not to have joined it (left or missing),
    when the communicator can tell (COMM-60); empty otherwise.
    """

    ranks: tuple[int, ...] = ()


class CommTimeout(CommError, TimeoutError):
    """A collective did not complete within its timeout: a peer is missing or late (COMM-5)."""


class CommAborted(CommError):
    """A peer left the world (raised, crashed) while this rank waited in a collective (COMM-6)."""


class ModelFault(RuntimeError):
    """The exception a fault placed by the model checker raises (MODEL-1)."""


class PeerLost(CommError):
    """Stands for a rank that did not join a collective: it left, died, or is late (COMM-61)."""


class CollectiveMismatch(CommError):
    """Ranks called different collectives at the same position (COMM-7)."""


@dataclass(frozen=True)
class Failure:
    """One rank's failure, as it travels through collectives (ERR-3).

    It carries the original exception when that pickles, and always its
    formatted traceback text, so a failure is never lost to an unpicklable
    exception.
    """

    rank: int
    step: str
    exception: BaseException
    traceback_text: str

    @classmethod
    def capture(cls, rank: int, step: str, exc: BaseException) -> Failure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank=rank, step=str(step), exception=_picklable(exc), traceback_text=text)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


@dataclass(frozen=True)
class FailureReport:
    """The failures the ranks agreed on, as plain data (PROTO-4, ERR-3).

    The protocol machine keeps and merges reports; a driver raises one as a
    :class:`~refdcp.errors.CheckpointError` (same ``step``, ``rank_failures``,
    ``committed`` and message).
    """

    step: str
    rank_failures: Mapping[int, Failure]
    committed: bool | None = False

    def __str__(self) -> str:
        return describe_failures(self.step, self.rank_failures, self.committed)


def commit_status(failures: Mapping[int, Failure], committed: bool | None) -> str:
    """Whether the checkpoint was committed, in words; the reason when unknown (SAVE-9, SAVE-15)."""
    if committed:
        return "the checkpoint WAS committed before this failure"
    if committed is False:
        return "nothing was committed"
    at_commit = [r for r, f in failures.items() if f.step == "commit"]
    if at_commit:
        why = (
            f"StorageWriter.finish raised on rank {at_commit[0]} and may have committed "
            "before raising"
        )
    else:
        lost = [r for r, f in failures.items() if isinstance(f.exception, CommError)]
        why = (
            f"rank(s) {lost or sorted(failures)} lost the coordinator after "
            "sending their write results; it may have committed"
        )
    return f"commit status UNKNOWN: {why}; check the checkpoint (refdcp verify PATH)"


def describe_failures(step: str, failures: Mapping[int, Failure], committed: bool | None) -> str:
    """The message of a failed save or load: what failed where, and whether it committed (ERR-1)."""
    state = commit_status(failures, committed)
    parts = [f"checkpoint {step} failed on rank(s) {sorted(failures)} ({state})"]
    for rank, f in sorted(failures.items()):
        parts.append(
            f"--- rank {rank}, step {f.step!r}: {type(f.exception).__name__}: {f.exception}\n"
            f"{f.traceback_text.rstrip()}"
        )
    return "\n".join(parts)
