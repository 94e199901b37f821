"""Exceptions raised by refdcp (spec/errors.md).

Every failure of a collective save or load surfaces as :class:`CheckpointError`
on every rank (ERR-1). It subclasses both ``Exception`` (so ``except Exception``
catches it, unlike torch's ``CheckpointException``) and torch's
``CheckpointException`` (so code written for torch keeps working) (ERR-2).
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointError",
    "CommError",
    "CommAborted",
    "CommTimeout",
    "Failure",
    "ProblemsError",
    "ProtocolError",
    "RefdcpError",
]


class RefdcpError(Exception):
    """Base class of refdcp's own errors that are not collective failures."""


class ProblemsError(ValueError):
    """Every problem found at once, one per line after ``headline`` (META-5, POLICY-1).

    Rebuilt from ``problems`` when unpickled, so it survives collectives (ERR-3).
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
        return cls(rank=rank, step=step, exception=_picklable(exc), traceback_text=text)


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class CheckpointError(CheckpointException, Exception):
    """A save or load failed on at least one rank; raised identically on every rank (ERR-1).

    ``failures`` maps rank -> (exception, StackSummary) exactly like torch's
    ``CheckpointException.failures``; ``tracebacks`` maps rank -> formatted
    traceback text; ``steps`` maps rank -> the protocol step that failed;
    ``committed`` tells whether the checkpoint reached its commit point before
    the failure (SAVE-9): True, False, or None when this rank cannot know
    (SAVE-15); ``commit_status`` says it in words, with the reason.
    """

    def __init__(
        self, step: str, failures: Mapping[int, Failure], *, committed: bool | None = False
    ) -> None:
        wrapped = {
            rank: (f.exception, traceback.StackSummary.from_list([]))
            for rank, f in failures.items()
        }
        super().__init__(step, wrapped)
        self.step = step
        self.rank_failures: dict[int, Failure] = dict(sorted(failures.items()))
        self.tracebacks = {rank: f.traceback_text for rank, f in self.rank_failures.items()}
        self.steps = {rank: f.step for rank, f in self.rank_failures.items()}
        self.committed = committed

    @property
    def commit_status(self) -> str:
        """Whether the checkpoint was committed, in words; the reason when unknown (SAVE-15)."""
        if self.committed:
            return "the checkpoint WAS committed before this failure"
        if self.committed is False:
            return "nothing was committed"
        at_commit = [r for r, f in self.rank_failures.items() if f.step == "commit"]
        if at_commit:
            why = (
                f"StorageWriter.finish raised on rank {at_commit[0]} and may have committed "
                "before raising"
            )
        else:
            lost = [r for r, f in self.rank_failures.items() if isinstance(f.exception, CommError)]
            why = (
                f"rank(s) {lost or sorted(self.rank_failures)} lost the coordinator after "
                "sending their write results; it may have committed"
            )
        return f"commit status UNKNOWN: {why}; check the checkpoint (refdcp verify PATH)"

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_checkpoint_error, (self.step, self.rank_failures, self.committed))

    def __str__(self) -> str:
        head = (
            f"checkpoint {self.step} failed on rank(s) {sorted(self.rank_failures)} "
            f"({self.commit_status})"
        )
        parts = [head]
        for rank, f in self.rank_failures.items():
            parts.append(
                f"--- rank {rank}, step {f.step!r}: {type(f.exception).__name__}: {f.exception}\n"
                f"{f.traceback_text.rstrip()}"
            )
        return "\n".join(parts)


def _rebuild_checkpoint_error(
    step: str, failures: Mapping[int, Failure], committed: bool | None
) -> CheckpointError:
    return CheckpointError(step, failures, committed=committed)
