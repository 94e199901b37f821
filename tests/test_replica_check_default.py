"""Replica disagreement is detected by default, at a digest cost paid only where needed (DEDUP-13)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import local_plan
from refdcp.testing.spawn import run_gloo

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _count_digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = local_plan.tensor_digests

    def counting(tensors: list[torch.Tensor]) -> list[int]:
        seen.extend(t.numel() for t in tensors)
        return real(tensors)

    monkeypatch.setattr(local_plan, "tensor_digests", counting)
    return seen


@pytest.mark.spec("DEDUP-13")
def test_a_single_rank_save_digests_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_digests(monkeypatch)
    refdcp.save({"w": torch.ones(1000), "b": torch.zeros(3)}, checkpoint_id=tmp_path, no_dist=True)
    assert seen == []


@pytest.mark.spec("DEDUP-13")
def test_coordinator_digests_only_what_others_hold(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _count_digests(monkeypatch)

    def rank(comm: Any) -> None:
        sd = {"shared": torch.ones(7), f"own{comm.rank}": torch.ones(100 + comm.rank)}
        refdcp.save(sd, checkpoint_id=tmp_path, comm=comm)

    FakeWorld(2).run(rank)
    # rank 1 digests both its items (it cannot know which are shared); rank 0 only "shared"
    assert sorted(seen) == [7, 7, 101]


@pytest.mark.spec("DEDUP-13", "DEDUP-6")
def test_coordinator_alone_disagreeing_is_reported(tmp_path: Any) -> None:
    def rank(comm: Any) -> str:
        sd = {"w": torch.full((3,), 1.0 if comm.rank else 5.0), "step": 4}
        with pytest.raises(CheckpointError) as err:
            refdcp.save(sd, checkpoint_id=tmp_path, comm=comm)
        return str(err.value)

    msgs = FakeWorld(3).run(rank)
    assert all("'w'" in m and "ranks [0]" in m and "ranks [1, 2]" in m for m in msgs)
    assert not (tmp_path / ".metadata").exists()


def _dtensor_digests(rank: int, world: int, path: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names: list[str] = []
    real = local_plan.replica_checksums

    def spy(flat: Any, items: Any, **kinds: bool) -> dict[Any, int]:
        out = real(flat, items, **kinds)
        names.extend(sorted({k[0] for k in out}))
        return out

    local_plan.replica_checksums = spy  # type: ignore[assignment]
    from refdcp.planning import replica_late, save_planner

    save_planner.replica_checksums = spy  # type: ignore[assignment]
    replica_late.replica_checksums = spy  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "sharded": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.arange(4.0), mesh, [Replicate()]),
    }
    refdcp.save(sd, checkpoint_id=path)
    return names


@pytest.mark.spec("DEDUP-13")
def test_dtensor_shards_held_by_one_rank_are_not_digested() -> None:
    with tempfile.TemporaryDirectory() as d:
        got = run_gloo(2, _dtensor_digests, f"{d}/ckpt", timeout=150)
    assert got == [["replicated"], ["replicated"]]
