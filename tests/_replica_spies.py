"""Shared by the replica-check tests (DEDUP-13, DEDUP-17): a spy on what is digested, and a
planner that digests in its local plans as when torch's ``dcp.save`` drives it."""

from __future__ import annotations

from typing import Any

import pytest

from refdcp.planning import DefaultSavePlanner, local_plan
from refdcp.planning.dedup import deferred as replica_late


class EarlyDigests(DefaultSavePlanner):
    """Digests in the local plans, compared in the global plan (DEDUP-13, torch's driver)."""

    def defer_replica_digests(self) -> None:
        pass


def count_digested(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the tensors digested, in the plans and after them (DEDUP-13, DEDUP-17)."""
    seen: list[int] = []
    real = local_plan.replica_tensors

    def counting(*args: Any, **kw: Any) -> Any:
        keys, tensors, seeds = real(*args, **kw)
        seen.extend(t.numel() for t in tensors)
        return keys, tensors, seeds

    monkeypatch.setattr(local_plan, "replica_tensors", counting)
    monkeypatch.setattr(replica_late, "replica_tensors", counting)
    return seen
