"""refdcp's default save and load planners, built from pure functions (spec/planning.md)."""

from __future__ import annotations

from .errors import (
    LoadPolicyError,
    PlanCacheError,
    PlanValidationError,
    ReplicaMismatchError,
    UnloadableValueError,
)
from .flatten import flatten_state_dict, unflatten_state_dict
from .load_planner import DefaultLoadPlanner
from .load_policy import LoadPolicy
from .local_shards import LocalShards
from .save_planner import DefaultSavePlanner

__all__ = [
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "LoadPolicy",
    "LoadPolicyError",
    "LocalShards",
    "PlanCacheError",
    "PlanValidationError",
    "ReplicaMismatchError",
    "UnloadableValueError",
    "flatten_state_dict",
    "unflatten_state_dict",
]
