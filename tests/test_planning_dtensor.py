"""DTensor resharding under spawned Gloo ranks with refdcp's planners in torch's dcp (PLAN-2, RESHARD-4)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from refdcp.testing.spawn import run_gloo

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
