"""Replica disagreement is detected by default, at a digest cost paid only where needed (DEDUP-13)."""

from __future__ import annotations

import tempfile
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import local_plan
from refdcp.planning.dedup import deferred as replica_late
from refdcp.testing.spawn import run_gloo
from tests._replica_spies import EarlyDigests, count_digested

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.mark.spec("DEDUP-13", "DEDUP-22")
def test_a_single_rank_save_digests_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # single path: which replicas the fast planner digests is its own speed choice
    seen = count_digested(monkeypatch)
    refdcp.save({"w": torch.ones(1000), "b": torch.zeros(3)}, checkpoint_id=tmp_path, no_dist=True)
    assert seen == []


@pytest.mark.spec("DEDUP-13", "DEDUP-17", "DEDUP-19", "DEDUP-22")
def test_a_rank_digests_only_replicas_it_does_not_write(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: which replicas the fast planner digests is its own speed choice
    seen = count_digested(monkeypatch)

    def rank(comm: Any) -> None:
        sd = {"shared": torch.ones(7), f"own{comm.rank}": torch.ones(100 + comm.rank)}
        refdcp.save(sd, checkpoint_id=tmp_path, comm=comm)

    FakeWorld(2).run(rank)
    # "shared" goes to rank 0 (fewer bytes of its own): rank 1 digests it while writing;
    # what a rank writes is digested by its writer on the way (DEDUP-17)
    assert sorted(seen) == [7]


@pytest.mark.spec("DEDUP-13", "DEDUP-22")
def test_plan_digests_cover_what_others_may_hold(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: which replicas the fast planner digests is its own speed choice
    seen = count_digested(monkeypatch)

    def rank(comm: Any) -> None:
        sd = {"shared": torch.ones(7), f"own{comm.rank}": torch.ones(100 + comm.rank)}
        refdcp.save(sd, checkpoint_id=tmp_path, comm=comm, planner=EarlyDigests())

    FakeWorld(2).run(rank)
    # rank 1 digests both its items (it cannot know which are shared); rank 0 only "shared"
    assert sorted(seen) == [7, 7, 101]


@pytest.mark.spec("DEDUP-13", "DEDUP-6")
def test_coordinator_alone_disagreeing_is_reported(tmp_path: Any, impl: ModuleType) -> None:
    def rank(comm: Any) -> str:
        sd = {"w": torch.full((3,), 1.0 if comm.rank else 5.0), "step": 4}
        with pytest.raises(CheckpointError) as err:
            impl.save(sd, checkpoint_id=tmp_path, comm=comm)
        return str(err.value)

    msgs = FakeWorld(3).run(rank)
    assert all("'w'" in m and "ranks [0]" in m and "ranks [1, 2]" in m for m in msgs)
    assert not (tmp_path / ".metadata").exists()


def _dtensor_digests(rank: int, world: int, path: str, early: bool) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names: list[str] = []
    real = local_plan.replica_tensors

    def spy(*args: Any, **kw: Any) -> Any:
        keys, tensors, seeds = real(*args, **kw)
        names.extend(sorted({k[0] for k in keys}))
        return keys, tensors, seeds

    local_plan.replica_tensors = spy  # type: ignore[assignment]
    replica_late.replica_tensors = spy  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "sharded": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.arange(4.0), mesh, [Replicate()]),
    }
    refdcp.save(sd, checkpoint_id=path, planner=EarlyDigests() if early else None)
    return names


@pytest.mark.spec("DEDUP-13", "DEDUP-22")
def test_dtensor_shards_held_by_one_rank_are_not_digested() -> None:
    # single path: which replicas the fast planner digests is its own speed choice
    with tempfile.TemporaryDirectory() as d:
        early = run_gloo(2, _dtensor_digests, f"{d}/a", True, timeout=150)
        late = run_gloo(2, _dtensor_digests, f"{d}/b", False, timeout=150)
    assert early == [["replicated"], ["replicated"]]
    # DEDUP-17: rank 0 writes "replicated" and gets its digest from the writer
    assert late == [[], ["replicated"]]
