"""Recorded torch runs behind the spec's claims about torch 2.13 (HARN-30).

A sentence of ``spec/`` that says what torch does points here (or at another
test that runs torch) with a ``(checked: tests/...::test_...)`` marker; these
tests run torch's own ``dcp.load`` over a spawned Gloo group and assert what
the claim says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.testing.spawn import run_gloo


class _Counter(Stateful):
    """A ``Stateful`` that records every ``load_state_dict`` call."""

    def __init__(self) -> None:
        self.loaded: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"v": torch.zeros(2)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append(float(sd["v"][0]))


class _FailingReader(FileSystemReader):  # type: ignore[misc]
    """torch's reader, whose ``read_data`` raises on rank 1."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError("injected read failure on rank 1")
        return super().read_data(plan, planner)


def _torch_load_with_a_failed_read_on_rank_1(rank: int, world: int, path: str) -> dict[str, Any]:
    sd: dict[str, Any] = {"app": _Counter(), "step": 0, "w": torch.zeros(4)}
    source = {"app": {"v": torch.full((2,), 7.0)}, "step": 5, "w": torch.arange(4.0)}
    dcp.save(source, storage_writer=FileSystemWriter(path))
    control: dict[str, Any] = {"app": _Counter(), "step": 0, "w": torch.zeros(4)}
    dcp.load(control, storage_reader=FileSystemReader(path))  # the same load, applied
    try:
        dcp.load(sd, storage_reader=_FailingReader(path))
        raised = ""
    except CheckpointException as e:  # a BaseException in torch 2.13
        raised = f"{type(e).__name__} {sorted(e.failures)}"
    return {
        "control": (control["app"].loaded, control["step"]),
        "raised": raised,
        "applied": sd["app"].loaded,
        "step": sd["step"],
    }


@pytest.mark.dist
@pytest.mark.spec("LOAD-5")
def test_torch_applies_nothing_when_a_read_fails_on_any_rank(tmp_path: Path) -> None:
    """torch 2.13: the read all-gather raises on every rank before any apply."""
    got = run_gloo(2, _torch_load_with_a_failed_read_on_rank_1, str(tmp_path), timeout=120.0)
    for r in got:
        assert r["control"] == ([7.0], 5), got  # without the failure torch applies
        assert r["raised"] == "CheckpointException [1]" and r["applied"] == [] and r["step"] == 0
