"""Exceptions raised by refdcp (spec/errors.md): the home of the hierarchy (ERR-6).

Every failure of a collective save or load surfaces as :class:`CheckpointError`
on every rank (ERR-1). It subclasses both ``Exception`` (so ``except Exception``
catches it, unlike torch's ``CheckpointException``) and torch's
``CheckpointException`` (so code written for torch keeps working) (ERR-2).

Every exception class of refdcp is defined in an errors module: this one,
``errors_core.py`` (the torch-free part the protocol needs),
``planning/errors.py`` or ``storage/errors.py``; ``tests/test_layering.py``
fails on one defined anywhere else. Each name also imports from the modules
that raise it. The whole hierarchy (module of definition in brackets)::

    Exception
    ├── CheckpointError (+ torch CheckpointException)   a save/load failed; raised on every rank
    ├── RuntimeError
    │   ├── InjectedFault                               a fault the simulator plants (a user's error)
    │   ├── ModelFault                                  [errors_core] a fault the model checker places (MODEL-1)
    │   ├── SpawnError                                  spawned ranks failed, died or timed out (COMM-22)
    │   └── MetadataLoadError                           `refdcp inspect` cannot load .metadata (TOOL-7)
    └── RefdcpError                                     [errors_core] base of refdcp's own errors
        ├── ProtocolError                               [errors_core] an order violation (PROTO-3)
        ├── ProblemsError (+ ValueError)                [errors_core] every problem at once
        │   ├── PlanValidationError                     [planning.errors] (META-5)
        │   │   └── ReplicaMismatchError                [planning.errors] (DEDUP-17)
        │   ├── LoadPolicyError                         [planning.errors] (POLICY-1)
        │   └── UnloadableValueError                    [planning.errors] values refused at save (SAVE-12)
        ├── PlanCacheError (+ RuntimeError)             [planning.errors] (PLAN-11)
        ├── CommError                                   [errors_core] a collective failed (COMM-5)
        │   ├── CommTimeout (+ TimeoutError)
        │   ├── CommAborted                             a peer left (COMM-6)
        │   ├── CollectiveMismatch                      ranks called different collectives (COMM-7)
        │   └── PeerLost                                a rank did not join a collective (COMM-61)
        ├── RankFailures                                ranks of FakeWorld.run raised (COMM-34)
        ├── Deadlock                                    simulated ranks would wait forever
        ├── NotProvidedError (+ AttributeError)         a torch DCP name refdcp does not provide (API-27)
        ├── StagingTimeoutError (+ TimeoutError)        no staging buffer became free (STAGE-5)
        ├── StateDictError (+ RuntimeError)             (SD-4)
        ├── ConvertError                                a conversion cannot be faithful (TOOL-21)
        ├── UnexplainedField (+ RuntimeError)           a plan field life-of-a-save cannot explain (TOOL-27)
        └── storage errors                              [storage.errors] (re-exported by refdcp.storage)
            ├── CorruptionError                         bytes do not match their checksum (INTEG-3)
            │   └── MalformedMetadataError              .metadata has a wrong shape (FMT-9)
            ├── MissingChecksumError                    verify asked, no checksum stored (INTEG-5)
            ├── UnsafeMetadataError                     .metadata names a forbidden global (FMT-6)
            │   └── UnsafePathError                     .metadata names an unsafe file (STORE-26)
            ├── UnsafeObjectError (+ UnpicklingError)   a saved value names a refused global (LOAD-9)
            ├── FormatVersionError                      unknown format version (FMT-7)
            ├── CheckpointExistsError (+ FileExistsError)  overwrite=False and one exists (STORE-6)
            ├── ConcurrentSaveError                     another save holds the lock
            ├── CheckpointMovedError                    the path was re-pointed during a save (STORE-57)
            ├── CheckpointReplacedError                 a save replaced the checkpoint a load read (LOAD-22, LOAD-23)
            ├── MetadataUnreadableError                 verify cannot read .metadata (TOOL-13)
            ├── TransformUnavailableError (+ ValueError)  a stream transform cannot be undone here (FMT-25)
            └── MetadataFieldMissing                    internal to the bulk metadata check

:class:`Failure` (one rank's failure) and :class:`FailureReport` (the failures
the ranks agreed on) are data, not exceptions: they travel through
collectives (ERR-3).
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from refdcp.errors_core import (
    CollectiveMismatch,
    CommAborted,
    CommError,
    CommTimeout,
    Failure,
    FailureReport,
    ModelFault,
    PeerLost,
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
    "ConvertError",
    "Deadlock",
    "Failure",
    "FailureReport",
    "InjectedFault",
    "MetadataLoadError",
    "ModelFault",
    "NotProvidedError",
    "PeerLost",
    "ProblemsError",
    "ProtocolError",
    "RankFailures",
    "RefdcpError",
    "SpawnError",
    "StagingTimeoutError",
    "StateDictError",
    "UnexplainedField",
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


class RankFailures(RefdcpError):
    """Some ranks of a :meth:`FakeWorld.run` raised (COMM-34).

    ``exceptions`` maps rank -> exception for the ranks that raised;
    ``results`` maps rank -> return value for the ranks that returned.
    """

    def __init__(self, exceptions: dict[int, BaseException], results: dict[int, Any]) -> None:
        self.exceptions = dict(sorted(exceptions.items()))
        self.results = dict(sorted(results.items()))
        parts = [f"rank(s) {sorted(self.exceptions)} raised"]
        for rank, exc in self.exceptions.items():
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            parts.append(f"--- rank {rank}: {type(exc).__name__}: {exc}\n{text.rstrip()}")
        super().__init__("\n".join(parts))


class NotProvidedError(RefdcpError, AttributeError):
    """A public name of torch's DCP that refdcp does not provide; says what to use (API-27)."""


class InjectedFault(RuntimeError):
    """The exception a :class:`Fault` raises."""


class Deadlock(RefdcpError):
    """Ranks would wait forever in a real process group."""


class StagingTimeoutError(RefdcpError, TimeoutError):
    """No buffer set became free within the pool's ``wait_timeout`` (STAGE-5)."""


class StateDictError(RefdcpError, RuntimeError):
    """A state dict does not fit the model or optimizer (SD-4, SD-7, SD-8)."""


class SpawnError(RuntimeError):
    """One or more spawned ranks failed, died, or did not finish in time (COMM-22).

    ``failures`` maps rank -> traceback text (or a description of how it
    died); ``results`` maps rank -> return value for the ranks that finished;
    ``timed_out`` tells whether the overall timeout expired.
    """

    def __init__(
        self,
        message: str,
        failures: dict[int, str],
        *,
        timed_out: bool,
        results: dict[int, Any] | None = None,
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        self.results = dict(sorted((results or {}).items()))
        self.timed_out = timed_out
        # True when every failure is a transient connect error raised before
        # the gate, so that no rank can have called fn (COMM-25).
        self.before_fn_only = False
        parts = [message]
        for rank, text in self.failures.items():
            parts.append(f"--- rank {rank} ---\n{text.rstrip()}")
        super().__init__("\n".join(parts))

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_spawn_error,
            (self.args[0], self.failures, self.timed_out, self.results),
        )


def _rebuild_spawn_error(
    message: str, failures: dict[int, str], timed_out: bool, results: dict[int, Any]
) -> SpawnError:
    err = SpawnError("", failures, timed_out=timed_out, results=results)
    err.args = (message,)
    return err


class ConvertError(RefdcpError):
    """A conversion that cannot be done faithfully; nothing was written (TOOL-21)."""


class MetadataLoadError(RuntimeError):
    """``.metadata`` is unreadable, corrupt or names a global outside the allow-list (TOOL-7)."""


class UnexplainedField(RefdcpError, RuntimeError):
    """A local plan carries a ``planner_data`` field that ``refdcp.tools.life_of_a_save``
    does not explain (TOOL-27): the generated page would teach nothing about it."""
