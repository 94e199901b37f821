"""DTensor resharding under spawned Gloo ranks with refdcp's planners in torch's dcp (PLAN-2, RESHARD-4)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from refdcp.testing.spawn import run_gloo

SINGLE_PATH = "refdcp's default planners inside torch's dcp under spawned Gloo ranks (PLAN-2): a differential test against torch"

pytestmark = pytest.mark.dist


def _full(name: str) -> torch.Tensor:
    shapes = {"s0": (7, 4), "rep": (5, 3), "s1": (6, 5)}
    n = 1
    for s in shapes[name]:
        n *= s
    return (torch.arange(n, dtype=torch.float32) * 1.5 + len(name)).reshape(shapes[name])


def _local_expected(name: str, mesh: Any, placements: Any) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = _full(name)
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    out = full
    for d, (o, n) in enumerate(zip(offset, shape)):
        out = out.narrow(d, o, n)
    return out


def _save(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from refdcp.planning import DefaultSavePlanner

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "s0": distribute_tensor(_full("s0"), mesh, [Shard(0)]),
        "rep": distribute_tensor(_full("rep"), mesh, [Replicate()]),
        "s1": distribute_tensor(_full("s1"), mesh, [Shard(1)]),
        "step": 11,
    }
    md = dcp.save(sd, checkpoint_id=path, planner=DefaultSavePlanner())
    out: dict[str, Any] = {
        "chunks": {
            k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]
            for k, v in md.state_dict_metadata.items()
            if hasattr(v, "chunks")
        }
    }
    partial = torch.distributed.tensor.DTensor.from_local(torch.ones(2), mesh, [Partial()])
    try:
        dcp.save({"p": partial}, checkpoint_id=path + "_partial", planner=DefaultSavePlanner())
        out["partial"] = "no error"
    except BaseException as exc:  # torch wraps planner errors in CheckpointException
        out["partial"] = str(exc)
    return out


def _load(rank: int, world: int, path: str) -> dict[str, bool]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from refdcp.planning import DefaultLoadPlanner

    mesh = init_device_mesh("cpu", (world,))
    layout = {"s0": [Shard(1)], "rep": [Replicate()], "s1": [Shard(0)]}
    sd: dict[str, Any] = {
        k: distribute_tensor(torch.zeros_like(_full(k)), mesh, p) for k, p in layout.items()
    }
    sd["step"] = 0
    dcp.load(sd, checkpoint_id=path, planner=DefaultLoadPlanner())
    ok = {k: torch.equal(sd[k].to_local(), _local_expected(k, mesh, layout[k])) for k in layout}
    ok["step"] = sd["step"] == 11
    return ok


@pytest.mark.spec("RESHARD-4", "PLAN-1", "PLAN-2", "DEDUP-1")
@pytest.mark.timeout(240)
def test_dtensor_save_at_2_load_at_1_3_4() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/ckpt"
        saved = run_gloo(2, _save, path, timeout=120)
        chunks = saved[0]["chunks"]
        assert chunks["rep"] == [((0, 0), (5, 3))]  # Replicate() stored once
        assert sorted(chunks["s0"]) == [((0, 0), (4, 4)), ((4, 0), (3, 4))]
        assert sorted(chunks["s1"]) == [((0, 0), (6, 3)), ((0, 3), (6, 2))]
        for r in saved:
            assert "'p'" in r["partial"] and "Partial" in r["partial"]
        for world in (1, 3, 4):
            results = run_gloo(world, _load, path, timeout=120)
            assert len(results) == world
            for rank, ok in enumerate(results):
                assert all(ok.values()), (world, rank, ok)


def _full2d(name: str) -> torch.Tensor:
    shape = {"a": (5, 3), "b": (3, 7), "c": (2, 2)}[name]
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32) + 10 * ord(name)).reshape(shape)


def _save_2d_mesh(rank: int, world: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import refdcp

    mesh = init_device_mesh("cpu", (2, 2))
    sd = {
        "a": distribute_tensor(_full2d("a"), mesh, [Shard(0), Shard(1)]),  # uneven both ways
        "b": distribute_tensor(_full2d("b"), mesh, [Replicate(), Shard(1)]),
        "c": distribute_tensor(_full2d("c"), mesh, [Shard(1), Replicate()]),
        "cfg": {"tags": {"alpha", "beta", "gamma"}},  # a set: checksummed per process seed
    }
    md = refdcp.save(sd, checkpoint_id=path, planner=refdcp.DefaultSavePlanner(check_replicas=True))
    return {
        k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks")
    }


def _load_1d_mesh(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import refdcp

    mesh = init_device_mesh("cpu", (world,))
    layout = {"a": [Shard(1)], "b": [Shard(0)], "c": [Replicate()]}
    sd: dict[str, Any] = {
        k: distribute_tensor(torch.zeros_like(_full2d(k)), mesh, p) for k, p in layout.items()
    }
    sd["cfg"] = {"tags": None}
    refdcp.load(sd, checkpoint_id=path)
    ok = all(torch.equal(sd[k].full_tensor(), _full2d(k)) for k in layout)
    return ok and sd["cfg"]["tags"] == {"alpha", "beta", "gamma"}


@pytest.mark.spec("PLAN-1", "RESHARD-4", "DEDUP-1", "DEDUP-6")
def test_dtensor_2d_mesh_saved_at_4_loads_on_1d_meshes() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/ckpt"
        chunks = run_gloo(4, _save_2d_mesh, path, timeout=150)[0]
        # Replicate() along a mesh dim is stored once: 4 chunks of a, 2 of b, 2 of c
        assert [len(chunks[k]) for k in ("a", "b", "c")] == [4, 2, 2]
        for world in (2, 3):
            assert run_gloo(world, _load_1d_mesh, path, timeout=150) == [True] * world
