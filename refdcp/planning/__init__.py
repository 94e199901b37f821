"""refdcp's default save and load planners, built from pure functions (spec/planning.md)."""

from __future__ import annotations

from .dedup.deferred import ReplicaMismatchError
from .flatten import flatten_state_dict, unflatten_state_dict
from .load_planner import DefaultLoadPlanner
from .load_policy import LoadPolicy, LoadPolicyError
from .local_shards import LocalShards
from .metadata.build import PlanValidationError
from .save_planner import DefaultSavePlanner

__all__ = [
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "LoadPolicy",
    "LoadPolicyError",
    "LocalShards",
    "PlanValidationError",
    "ReplicaMismatchError",
    "flatten_state_dict",
    "unflatten_state_dict",
]
