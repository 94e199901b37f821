"""The reference path's entry points (refdcp/reference/api.py) keep the public contract:
a storage object instead of ``checkpoint_id`` (API-5), the committed Metadata returned on every
rank (API-1), and ``is_coordinator`` true on the coordinator rank only (SAVE-1, LOAD-1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.reference import ReferenceReader, ReferenceWriter
from refdcp.reference.load_planner import ReferenceLoadPlanner
from refdcp.reference.save_planner import ReferenceSavePlanner

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"


@pytest.mark.spec("API-5", "REF-1")
def test_a_storage_writer_or_reader_stands_for_checkpoint_id(tmp_path: Path) -> None:
    sd = {"w": torch.arange(6.0), "n": 3}
    md = refdcp.reference.save(sd, storage_writer=ReferenceWriter(tmp_path), comm=SingleRank())
    out: dict[str, Any] = {"w": torch.zeros(6), "n": 0}
    refdcp.reference.load(out, storage_reader=ReferenceReader(tmp_path), comm=SingleRank())
    assert torch.equal(out["w"], sd["w"]) and out["n"] == 3
    assert set(md.state_dict_metadata) == {"w", "n"}
    with pytest.raises(ValueError, match="checkpoint_id"):
        refdcp.reference.save(sd, comm=SingleRank())
    with pytest.raises(ValueError, match="checkpoint_id"):
        refdcp.reference.load(out, comm=SingleRank())


@pytest.mark.spec("API-1", "REF-1")
@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_returns_the_committed_metadata(tmp_path: Path, world: int) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    mds = FakeWorld(world).run(
        lambda c: refdcp.reference.save(dict(sd), checkpoint_id=tmp_path, comm=c)
    )
    stored = ReferenceReader(tmp_path).read_metadata()
    for md in mds:
        assert md is not None and md.state_dict_metadata == stored.state_dict_metadata
        assert list(md.state_dict_metadata) == ["w"]


class _SeenSave(ReferenceSavePlanner):
    def __init__(self, seen: dict[int, bool], rank: int) -> None:
        super().__init__()
        self.seen, self.rank = seen, rank

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.seen[self.rank] = self.is_coordinator


class _SeenLoad(ReferenceLoadPlanner):
    def __init__(self, seen: dict[int, bool], rank: int) -> None:
        super().__init__()
        self.seen, self.rank = seen, rank

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.seen[self.rank] = is_coordinator


@pytest.mark.spec("SAVE-1", "LOAD-1", "COMM-2", "REF-1")
@pytest.mark.parametrize("coordinator", [0, 2])
def test_planners_are_told_which_rank_coordinates(tmp_path: Path, coordinator: int) -> None:
    saw: dict[int, bool] = {}
    FakeWorld(3, coordinator_rank=coordinator).run(
        lambda c: refdcp.reference.save(
            {"w": torch.ones(4)}, checkpoint_id=tmp_path, comm=c, planner=_SeenSave(saw, c.rank)
        )
    )
    assert saw == {r: r == coordinator for r in range(3)}
    got: dict[int, bool] = {}
    FakeWorld(3, coordinator_rank=coordinator).run(
        lambda c: refdcp.reference.load(
            {"w": torch.zeros(4)}, checkpoint_id=tmp_path, comm=c, planner=_SeenLoad(got, c.rank)
        )
    )
    assert got == {r: r == coordinator for r in range(3)}
