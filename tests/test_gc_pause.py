"""save/load pause the cyclic garbage collector and restore it (spec/api.md, API-20)."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp
from refdcp.driver.gcpause import gc_paused

SINGLE_PATH = "tests the default path pausing the garbage collector (API-20), a speed idiom the reference does without (REF-7)"


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


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.spec("API-20", "API-21")
def test_what_survives_a_save_skips_the_young_generations(tmp_path: Path) -> None:
    """The returned Metadata is not left for young passes: the youngest generation's count is
    back near zero, its objects are still tracked, and cycles made during the call are still
    collected by a full pass."""
    sd = {f"w{i}": torch.zeros(4) for i in range(500)}
    gc.collect()
    before = len(gc.get_objects(generation=2))
    md = refdcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    assert gc.isenabled()
    assert gc.get_count()[0] < 100, gc.get_count()
    assert gc.is_tracked(md.storage_data)
    # the metadata's objects went straight to the oldest generation
    assert len(gc.get_objects(generation=2)) > before + 500
    with gc_paused():
        probe = _Cycle()
        wr = weakref.ref(probe)
        del probe
    assert wr() is not None  # a cycle: only the collector frees it
    gc.collect()
    assert wr() is None


@pytest.mark.spec("API-20", "API-21")
def test_objects_the_caller_froze_stay_frozen(tmp_path: Path) -> None:
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        refdcp.save({"w": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True)
        with gc_paused():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
