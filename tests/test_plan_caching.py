"""Plan caching across saves (PLAN-9..12): reused when the structure is unchanged, rebuilt when not."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultSavePlanner, LocalShards

SINGLE_PATH = "plan caching (PLAN-9..12) is a speed feature of the default planners"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class RecordingPlanner(DefaultSavePlanner):
    """Records, per save, whether this rank sent a cached-plan marker."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.markers: list[bool] = []

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        self.markers.append(not plan.usable)
        return plan


def _state(rank: int, world: int, step: int, variant: dict[str, Any]) -> dict[str, Any]:
    n = variant.get("rows", 4)
    rows = variant.get("split", 2)
    sd: dict[str, Any] = {
        "shared": torch.full((3,), float(step)),  # replicated, value changes every save
        f"own{rank}": torch.full(
            (n,), float(rank * 100 + step), dtype=variant.get("dtype", torch.float32)
        ),
        "step": step,
        "sharded": LocalShards(
            (world * rows, 2),
            [((rank * rows, 0), torch.full((rows, 2), float(rank + step)))],
        ),
    }
    if variant.get("extra"):
        sd["extra"] = torch.ones(2)
    return sd


def _run(world: int, variants: list[list[dict[str, Any]]], caching: bool) -> Any:
    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> tuple[list[Any], list[bool]]:
        planner = RecordingPlanner(enable_plan_caching=caching)
        mds = []
        for step, per_rank in enumerate(variants):
            sd = _state(comm.rank, world, step, per_rank[comm.rank])
            md = refdcp.save(
                sd, storage_writer=storage.writer(f"c{step}"), planner=planner, comm=comm
            )
            mds.append(md.state_dict_metadata)
        return mds, planner.markers

    out = FakeWorld(world).run(rank)
    return storage, out


def _check_loads(storage: Any, world: int, variants: list[list[dict[str, Any]]]) -> None:
    for step, per_rank in enumerate(variants):

        def rank(comm: Any, step: int = step, per_rank: Any = per_rank) -> None:
            want = _state(comm.rank, world, step, per_rank[comm.rank])
            dest = _state(comm.rank, world, step, per_rank[comm.rank])
            for _k, v in dest.items():
                if isinstance(v, LocalShards):
                    for _, t in v.chunks:
                        t.zero_()
                elif isinstance(v, torch.Tensor):
                    v.zero_()
            dest["step"] = -1
            refdcp.load(dest, storage_reader=storage.reader(f"c{step}"), comm=comm)
            assert dest["step"] == step
            for k, v in want.items():
                if isinstance(v, LocalShards):
                    for (_, a), (_, b) in zip(v.chunks, dest[k].chunks):
                        assert torch.equal(a, b), (step, k)
                elif isinstance(v, torch.Tensor):
                    assert torch.equal(dest[k], v), (step, k)

        FakeWorld(world).run(rank)


def _normal(variant: dict[str, Any]) -> dict[str, Any]:
    return {"rows": 4, "split": 2, "dtype": torch.float32, "extra": False, **variant}


VARIANT = st.fixed_dictionaries(
    {},
    optional={
        "rows": st.sampled_from([4, 5]),
        "dtype": st.sampled_from([torch.float32, torch.float64]),
        "extra": st.booleans(),
    },
)


@pytest.mark.spec("PLAN-9", "PLAN-10", "PLAN-11")
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_cached_saves_equal_uncached_saves(data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 3))
    saves = data.draw(st.integers(2, 4))
    variants = []
    for _ in range(saves):  # the sharding changes for every rank at once (one global shape)
        split = data.draw(st.sampled_from([2, 3]))
        variants.append([{**data.draw(VARIANT), "split": split} for _ in range(world)])
    storage, cached = _run(world, variants, caching=True)
    _, plain = _run(world, variants, caching=False)
    for r in range(world):
        assert cached[r][0] == plain[r][0]  # same metadata every save
    _check_loads(storage, world, variants)
    # a rank sends a marker exactly when its structure equals its previous save's
    for r in range(world):
        norm = [_normal(variants[i][r]) for i in range(saves)]
        want = [False] + [norm[i] == norm[i - 1] for i in range(1, saves)]
        assert cached[r][1] == want


@pytest.mark.spec("PLAN-10", "DEDUP-13")
def test_cached_path_still_compares_replica_values() -> None:
    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> tuple[list[bool], str]:
        planner = RecordingPlanner(enable_plan_caching=True)
        for step in range(2):
            sd = {"w": torch.full((4,), float(step))}
            refdcp.save(sd, storage_writer=storage.writer(f"c{step}"), planner=planner, comm=comm)
        bad = {"w": torch.full((4,), float(comm.rank))}  # same structure, replicas disagree
        with pytest.raises(CheckpointError) as err:
            refdcp.save(bad, storage_writer=storage.writer("bad"), planner=planner, comm=comm)
        alone = {"w": torch.full((4,), 9.0 if comm.rank == 0 else 1.0)}  # the coordinator alone
        with pytest.raises(CheckpointError) as err2:
            refdcp.save(alone, storage_writer=storage.writer("bad2"), planner=planner, comm=comm)
        return planner.markers, str(err.value) + str(err2.value)

    for markers, msg in FakeWorld(3).run(rank):
        assert markers == [False, True, True, True]
        assert "differ in value" in msg and "'w'" in msg and "ranks [1, 2]" in msg


@pytest.mark.spec("PLAN-12")
def test_failed_plan_keeps_the_previous_cache() -> None:
    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> list[bool]:
        planner = RecordingPlanner(enable_plan_caching=True)
        good = {"w": torch.ones(4), f"own{comm.rank}": torch.ones(comm.rank + 1)}
        refdcp.save(good, storage_writer=storage.writer("a"), planner=planner, comm=comm)
        bad = {"w": torch.ones(4 + comm.rank)}  # replicas disagree in shape: the plan fails
        with pytest.raises(CheckpointError):
            refdcp.save(bad, storage_writer=storage.writer("b"), planner=planner, comm=comm)
        refdcp.save(good, storage_writer=storage.writer("c"), planner=planner, comm=comm)
        return planner.markers

    assert FakeWorld(2).run(rank) == [[False, False, True]] * 2


@pytest.mark.spec("PLAN-11")
def test_marker_without_coordinator_cache_is_a_clear_error() -> None:
    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> str:
        planner = DefaultSavePlanner(enable_plan_caching=True)
        refdcp.save(
            {"w": torch.ones(2)}, storage_writer=storage.writer("a"), planner=planner, comm=comm
        )
        if comm.rank == 0:
            planner = DefaultSavePlanner(enable_plan_caching=True)  # coordinator forgot its cache
        with pytest.raises(CheckpointError) as err:
            refdcp.save(
                {"w": torch.ones(2)}, storage_writer=storage.writer("b"), planner=planner, comm=comm
            )
        return str(err.value)

    assert all("one DefaultSavePlanner instance" in m for m in FakeWorld(2).run(rank))


@pytest.mark.spec("PLAN-9")
def test_torch_accepts_refdcp_cached_plans(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    planner = DefaultSavePlanner(enable_plan_caching=True)
    for step in range(3):
        sd = {"w": torch.full((3,), float(step)), "step": step}
        dcp.save(sd, checkpoint_id=tmp_path / str(step), planner=planner, no_dist=True)
        dest = {"w": torch.zeros(3), "step": -1}
        dcp.load(dest, checkpoint_id=tmp_path / str(step), no_dist=True)
        assert dest["step"] == step and torch.equal(dest["w"], sd["w"])
