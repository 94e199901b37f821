"""Errors raised by refdcp's planners (spec/planning.md); drawn in refdcp/errors.py (ERR-6)."""

from __future__ import annotations

from collections.abc import Sequence

from refdcp.errors_core import ProblemsError, RefdcpError

__all__ = [
    "LoadPolicyError",
    "PlanCacheError",
    "PlanValidationError",
    "ReplicaMismatchError",
    "UnloadableValueError",
]


class PlanValidationError(ProblemsError):
    """The global save plan is inconsistent; ``problems`` lists every violation (META-5)."""

    headline = "invalid global save plan"


class LoadPolicyError(ProblemsError):
    """The state dict does not fit the checkpoint; ``problems`` lists every mismatch (POLICY-1)."""

    headline = "state_dict does not match the checkpoint"

    def __init__(self, problems: Sequence[str], checkpoint: str | None = None) -> None:
        super().__init__(problems)
        self.checkpoint: str | None = None
        if checkpoint is not None:
            self.name_checkpoint(checkpoint)

    def name_checkpoint(self, checkpoint: str) -> None:
        """Name the checkpoint the state dict was checked against in the message (API-23)."""
        self.checkpoint = checkpoint
        self.args = (
            str(self.args[0]).replace(self.headline, f"{self.headline} at {checkpoint}", 1),
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.problems, self.checkpoint))


class UnloadableValueError(ProblemsError):
    """Values refused at save: one line per key, naming type, cause and the allowing option (SAVE-12)."""

    headline = "refdcp.save refused values that cannot be saved or could never be loaded"


class PlanCacheError(RefdcpError, RuntimeError):
    """A rank sent a cached-plan marker the coordinator cannot resolve (PLAN-11)."""


class ReplicaMismatchError(PlanValidationError):
    """Ranks wrote different values under one replicated key; nothing was committed (DEDUP-17)."""

    headline = "replicas differ in value"
