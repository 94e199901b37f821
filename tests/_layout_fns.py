"""Top-level functions run inside spawned Gloo ranks for the stored-layout tests (FMT-28)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor import Shard as DShard

import refdcp


def torch_saves_sharded(rank: int, world: int, path: str) -> list[str]:
    """torch's dcp.save of DTensors (uneven rows, columns, 2-D meshes), a ShardedTensor with
    uneven shards and a LocalShards with a rank holding nothing; returns the saved keys."""
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, object] = {
        "rows": distribute_tensor(full, mesh, [DShard(0)]),
        "cols": distribute_tensor(full, mesh, [DShard(1)]),
        "rep": distribute_tensor(full, mesh, [Replicate()]),
        "plain": full.clone(),
    }
    if world > 1:
        mesh2 = init_device_mesh("cpu", (world, 1))
        sd["grid"] = distribute_tensor(full, mesh2, [DShard(0), DShard(1)])
    # a ShardedTensor: rank r holds rows [r * 3, r * 3 + 3) of a (3 * world - 1, 4) tensor
    rows = [min(3, 3 * world - 1 - r * 3) for r in range(world)]
    metas = [ShardMetadata([r * 3, 0], [rows[r], 4], f"rank:{r}/cpu") for r in range(world)]
    local = torch.full((rows[rank], 4), float(rank))
    sd["sharded"] = ShardedTensor._init_from_local_shards(
        [Shard(local, metas[rank])], (3 * world - 1, 4)
    )
    # the last of several ranks holds nothing of this one
    holders = max(1, world - 1)
    held = [((rank * 2, 0), torch.ones(2, 3))] if rank < holders else []
    sd["shards"] = refdcp.LocalShards((2 * holders, 3), held, dtype=torch.float32)
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    return sorted(sd)
