"""Exceptions raised by refdcp (spec/errors.md): the home of the hierarchy (ERR-6).

Every failure of a collective save or load surfaces as :class:`CheckpointError`
on every rank (ERR-1). It subclasses both ``Exception`` (so ``except Exception``
catches it, unlike torch's ``CheckpointException``) and torch's
``CheckpointException`` (so code written for torch keeps working) (ERR-2).

The whole hierarchy (module of definition in brackets; every name imports
from here or from its package, except where noted)::

    Exception
    ├── CheckpointError (+ torch CheckpointException)   a save/load failed; raised on every rank
    └── RefdcpError                                     [errors_core] base of refdcp's own errors
        ├── ProtocolError                               [errors_core] an order violation (PROTO-3)
        ├── ProblemsError (+ ValueError)                [errors_core] every problem at once
        │   ├── PlanValidationError                     [planning.global_metadata] (META-5)
        │   │   └── ReplicaMismatchError                [planning.replica_late] (DEDUP-17)
        │   └── LoadPolicyError                         [planning.load_policy] (POLICY-1)
        ├── CommError                                   [errors_core] a collective failed (COMM-5)
        │   ├── CommTimeout (+ TimeoutError)
        │   ├── CommAborted                             a peer left (COMM-6)
        │   └── CollectiveMismatch                      ranks called different collectives (COMM-7)
        ├── RankFailures                                [comm.fake] ranks of FakeWorld.run raised
        ├── Deadlock                                    [driver.simulator] ranks would wait forever
        ├── StagingTimeoutError (+ TimeoutError)        [staging.buffer_pool] (STAGE-5)
        ├── StateDictError (+ RuntimeError)             [state.state_dict] (SD-4)
        └── storage errors                              [storage.errors] (re-exported by refdcp.storage)
            ├── CorruptionError                         bytes do not match their checksum (INTEG-3)
            ├── MissingChecksumError                    verify asked, no checksum stored (INTEG-5)
            ├── UnsafeMetadataError                     .metadata names a forbidden global (FMT-6)
            ├── FormatVersionError                      unknown format version (FMT-7)
            └── CheckpointExistsError (+ FileExistsError)  overwrite=False and one exists (STORE-6)

:class:`Failure` (one rank's failure) and :class:`FailureReport` (the failures
the ranks agreed on) are data, not exceptions: they travel through
collectives (ERR-3).
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping

from torch.distributed.checkpoint.api import CheckpointException

from refdcp.errors_core import (
    CollectiveMismatch,
    CommAborted,
    CommError,
    CommTimeout,
    Failure,
    FailureReport,
    ProblemsError,
    ProtocolError,
    RefdcpError,
    commit_status,
    describe_failures,
)

__all__ = [
    "CheckpointError",
    "CollectiveMismatch",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "Failure",
    "FailureReport",
    "ProblemsError",
    "ProtocolError",
    "RefdcpError",
]


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
        step = str(step)
        super().__init__(step, wrapped)
        self.step = step
        self.rank_failures: dict[int, Failure] = dict(sorted(failures.items()))
        self.tracebacks = {rank: f.traceback_text for rank, f in self.rank_failures.items()}
        self.steps = {rank: f.step for rank, f in self.rank_failures.items()}
        self.committed = committed

    @classmethod
    def from_report(cls, report: FailureReport) -> CheckpointError:
        """The exception a driver raises for the machine's agreed failures (PROTO-4)."""
        return cls(report.step, report.rank_failures, committed=report.committed)

    @property
    def report(self) -> FailureReport:
        return FailureReport(self.step, self.rank_failures, self.committed)

    @property
    def commit_status(self) -> str:
        """Whether the checkpoint was committed, in words; the reason when unknown (SAVE-15)."""
        return commit_status(self.rank_failures, self.committed)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_checkpoint_error, (self.step, self.rank_failures, self.committed))

    def __str__(self) -> str:
        return describe_failures(self.step, self.rank_failures, self.committed)


def _rebuild_checkpoint_error(
    step: str, failures: Mapping[int, Failure], committed: bool | None
) -> CheckpointError:
    return CheckpointError(step, failures, committed=committed)
