"""pytest integration: one test per conformance check (CONF-44).

In a backend's own test suite::

    from conformance.plugin import conformance_tests

    test_my_storage_conformance = conformance_tests("mypkg.module:backend")

Each check becomes ``test_my_storage_conformance[CONF-N]``: it fails on a
failed MUST, warns on a failed SHOULD, and skips with the reason when the
check does not apply to the backend's declared capabilities.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

from conformance.backend import Backend
from conformance.cli import load_backend
from conformance.runner import DEFAULT_TIMEOUT, all_checks, run_checks

__all__ = ["ConformanceWarning", "conformance_tests"]


class ConformanceWarning(UserWarning):
    """A SHOULD requirement that the backend does not meet."""


def conformance_tests(
    target: str | Backend | Callable[[], Backend],
    *,
    examples: int = 10,
    timeout: float = DEFAULT_TIMEOUT,
    profile: str | None = None,
) -> Callable[[str], None]:
    """A pytest test function parametrized over every check's requirement ID.

    A check still running after ``timeout`` seconds fails as timed out (CONF-51);
    ``profile`` lays a format's profile over the backend's capabilities (CONF-69).
    """

    def make() -> Backend:
        if isinstance(target, str):
            return load_backend(target)
        if isinstance(target, Backend):
            return target
        return target()

    ids = [c.id for c in all_checks()]

    @pytest.mark.parametrize("check_id", ids, ids=ids)
    def test_conformance(check_id: str) -> None:
        (result,) = run_checks(
            make(), only={check_id}, examples=examples, timeout=timeout, profile=profile
        )
        if result.status == "n/a":
            pytest.skip(f"{check_id} not applicable: {result.reason}")
        if result.status == "fail":
            if result.level.startswith("MUST"):
                pytest.fail(f"{check_id} ({result.level}) failed: {result.reason}", pytrace=False)
            warnings.warn(
                f"{check_id} ({result.level}): {result.reason}", ConformanceWarning, stacklevel=1
            )

    return test_conformance
