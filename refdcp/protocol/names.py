"""The names the protocol tables use: phases, local steps and context slots (PROTO-10).

Tables, drivers and step code refer to these members, never to bare strings,
so a typo is an ``AttributeError`` at import time instead of a ``None``
payload two steps later. Each member is also its ``str`` value (``Step.WRITE ==
"write"``), which is what traces, failures and messages show.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Phase", "Slot", "Step"]


class _Name(str, Enum):
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)


class Phase(_Name):
    """Where one rank's machine is."""

    IDLE = "idle"
    SET_UP = "set_up"
    LOCAL_PLAN = "local_plan"
    GATHER_PLANS = "gather_plans"
    GLOBAL_PLAN = "global_plan"
    SCATTER_PLANS = "scatter_plans"
    FINISH_PLAN = "finish_plan"
    WRITE = "write"
    GATHER_RESULTS = "gather_results"
    COMMIT = "commit"
    BROADCAST_OUTCOME = "broadcast_outcome"
    READ = "read"
    GATHER_READ = "gather_read"
    APPLY = "apply"
    GATHER_APPLIED = "gather_applied"
    DONE = "done"
    FAILED = "failed"


class Step(_Name):
    """A local step: one call into planners, storage or ``Stateful`` objects (PROTO-2)."""

    SET_UP = "set_up"
    LOCAL_PLAN = "local_plan"
    GLOBAL_PLAN = "global_plan"
    FINISH_PLAN = "finish_plan"
    WRITE = "write"
    COMMIT = "commit"
    READ = "read"
    APPLY = "apply"


class Slot(_Name):
    """A value in a rank's context: what a step produces and a collective sends or receives."""

    FLAT_STATE_DICT = "flat_state_dict"
    LOCAL_PLAN = "local_plan"
    ALL_PLANS = "all_plans"
    GLOBAL_PLANS = "global_plans"
    CENTRAL_PLAN = "central_plan"
    FINAL_PLAN = "final_plan"
    WRITE_RESULTS = "write_results"
    ALL_RESULTS = "all_results"
    METADATA = "metadata"
    READ_OUTCOME = "read_outcome"
    READ_OUTCOMES = "read_outcomes"
    APPLY_OUTCOME = "apply_outcome"
    APPLY_OUTCOMES = "apply_outcomes"
