"""Shared test configuration: hypothesis profiles and the spec marker."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test citing an unknown spec ID fails collection loudly."""
    from refdcp.tools.spec_report import load_spec, repo_root

    known, _ = load_spec(repo_root() / "spec")
    for item in items:
        for mark in item.iter_markers("spec"):
            unknown = [rid for rid in mark.args if rid not in known]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid} cites unknown spec IDs {unknown}")
