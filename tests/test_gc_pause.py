"""save/load pause the cyclic garbage collector and restore it (spec/api.md, API-20)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp
from refdcp.driver.gcpause import gc_paused


class _Probe(refdcp.DefaultSavePlanner):
    """Records whether the collector was enabled while the save planned."""

    seen: list[bool]

    def create_local_plan(self) -> Any:
        self.seen.append(gc.isenabled())
        return super().create_local_plan()


@pytest.mark.spec("API-20")
@pytest.mark.parametrize("enabled_before", [True, False])
def test_save_pauses_and_restores(tmp_path: Path, enabled_before: bool) -> None:
    probe = _Probe()
    probe.seen = []
    (gc.enable if enabled_before else gc.disable)()
    try:
        refdcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path, planner=probe, no_dist=True)
        assert probe.seen == [False]
        assert gc.isenabled() is enabled_before
        out = {"w": torch.zeros(3)}
        refdcp.load(out, checkpoint_id=tmp_path, no_dist=True)
        assert gc.isenabled() is enabled_before
        assert torch.equal(out["w"], torch.ones(3))
    finally:
        gc.enable()


@pytest.mark.spec("API-20")
def test_restored_after_an_error(tmp_path: Path) -> None:
    assert gc.isenabled()
    with pytest.raises(refdcp.CheckpointError):
        refdcp.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "missing", no_dist=True)
    assert gc.isenabled()


@pytest.mark.spec("API-20")
def test_other_threads_leave_the_collector_alone() -> None:
    seen: list[bool] = []

    def body() -> None:
        with gc_paused():
            seen.append(gc.isenabled())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [True]


@pytest.mark.spec("API-20")
def test_nested_pauses_reenable_once() -> None:
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
