"""Shared test configuration: hypothesis profiles, the spec marker, and ``impl``.

``impl`` is the implementation under test: a behavioural test that takes it runs
once on ``refdcp`` (the fast default path) and once on ``refdcp.reference`` (the
readable twin), as CPython runs one decimal suite over ``_decimal`` and
``_pydecimal`` (REF-6). Both modules offer the same user API (``save``, ``load``,
``async_save``, ``LocalShards``, the storage classes, planners and stagers).
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

import refdcp
import refdcp.reference

#: The two implementations every behavioural test runs on (REF-6).
IMPLEMENTATIONS: dict[str, ModuleType] = {"refdcp": refdcp, "reference": refdcp.reference}


@pytest.fixture(scope="session", params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """``refdcp`` or ``refdcp.reference``: the test runs once on each (REF-6)."""
    return IMPLEMENTATIONS[request.param]

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
