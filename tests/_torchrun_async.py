"""Run by tests/test_async_torchrun.py under ``torchrun``: every async_save flavour, then a load.

Each rank saves its own shard and a replicated tensor with the process executor,
the thread executor and torch's ``DefaultStager``, waits, loads each checkpoint
back into zeros and compares; it prints one line per flavour and exits 0.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import refdcp

warnings.filterwarnings("ignore")


def state(rank: int, world: int, fill: bool) -> dict[str, object]:
    rows = torch.arange(4.0 * world).reshape(world, 4) if fill else torch.zeros(world, 4)
    shard = refdcp.LocalShards([world, 4], [((rank, 0), rows[rank : rank + 1].clone())])
    return {"replicated": rows.clone(), "sharded": shard, "step": 7 if fill else 0}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    flavours = {
        "process": {"async_checkpointer_type": AsyncCheckpointerType.PROCESS},
        "thread": {"async_checkpointer_type": AsyncCheckpointerType.THREAD},
        "default_stager": {
            "async_stager": DefaultStager(StagingOptions(False, False, False, False))
        },
    }
    for name, kwargs in flavours.items():
        path = str(out / name)
        handle = refdcp.async_save(state(rank, world, True), checkpoint_id=path, **kwargs)
        metadata = handle.result(timeout=120)
        assert metadata.storage_meta is not None
        loaded = state(rank, world, False)
        refdcp.load(loaded, checkpoint_id=path)
        expected = state(rank, world, True)
        assert loaded["step"] == 7, loaded["step"]
        assert torch.equal(loaded["replicated"], expected["replicated"])  # type: ignore[arg-type]
        got = loaded["sharded"].chunks[0][1]  # type: ignore[attr-defined]
        assert torch.equal(got, expected["sharded"].chunks[0][1])  # type: ignore[attr-defined]
        print(f"rank {rank}/{world} {name} ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
