"""Top-level functions run inside spawned Gloo ranks (they must be picklable by reference)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.stateful import Stateful

import refdcp
from refdcp.errors import CheckpointError, CommTimeout


def rank_state(rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    return {
        "replicated": torch.randn(5, 3, generator=g),
        f"own.{rank}": torch.arange(rank * 10, rank * 10 + 6, dtype=torch.int64).reshape(2, 3),
        "bf16": torch.linspace(0, 1, 7).to(torch.bfloat16),
        "meta": {"world": world, "tag": "x"},
    }


def empty_like_state(rank: int, world: int) -> dict[str, Any]:
    src = rank_state(rank, world)
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in src.items() if isinstance(v, torch.Tensor)}
    out["meta"] = {"world": 0, "tag": ""}
    return out


def save_then_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """refdcp.save + refdcp.load over the real process group, torch's planner and storage."""
    md = refdcp.save(
        rank_state(rank, world),
        storage_writer=FileSystemWriter(path, sync_files=False),
        planner=DefaultSavePlanner(),
    )
    out = empty_like_state(rank, world)
    refdcp.load(out, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner())
    return {"keys": sorted(md.state_dict_metadata), "loaded": out}


class Exploding(Stateful):
    def __init__(self, explode: bool) -> None:
        self.explode = explode

    def state_dict(self) -> dict[str, Any]:
        if self.explode:
            raise RuntimeError("state_dict exploded on this rank")
        return {"v": torch.ones(2)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def stateful_explodes_on_rank1(rank: int, world: int, path: str) -> str:
    sd = {**rank_state(rank, world), "app": Exploding(rank == 1)}
    try:
        refdcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False), planner=DefaultSavePlanner())
    except CheckpointError as e:
        return f"{sorted(e.rank_failures)}|{e.steps}|{'exploded' in str(e)}"
    return "no error"


def fault_before_write_on_last_rank(rank: int, world: int, path: str) -> str:
    def fault(index: int, action: Any) -> None:
        if rank == world - 1 and action.step == "write":
            raise OSError("injected disk failure")

    try:
        refdcp.save(
            rank_state(rank, world),
            storage_writer=FileSystemWriter(path, sync_files=False),
            planner=DefaultSavePlanner(),
            fault=fault,
        )
    except CheckpointError as e:
        return f"{sorted(e.rank_failures)}|{e.committed}"
    return "no error"


def late_peer(rank: int, world: int, path: str, timeout: float) -> str:
    """Rank 1 arrives far later than the others' collective timeout."""
    from refdcp.comm import TorchDistComm

    comm = TorchDistComm(timeout=timeout)
    if rank == 1:
        time.sleep(timeout * 4)
        return "late"
    t0 = time.monotonic()
    try:
        refdcp.save(
            rank_state(rank, world),
            storage_writer=FileSystemWriter(path, sync_files=False),
            planner=DefaultSavePlanner(),
            comm=comm,
        )
    except CheckpointError as e:
        waited = time.monotonic() - t0
        ok = any(isinstance(f.exception, CommTimeout) for f in e.rank_failures.values())
        return f"timeout:{ok}:{waited < timeout * 3}"
    return "no error"


def cuda_roundtrip(rank: int, world: int, path: str) -> bool:
    """GPU: save CUDA tensors and load them back (through whatever backend the group uses)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    sd = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in rank_state(rank, world).items()}
    refdcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False), planner=DefaultSavePlanner())
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"world": 0, "tag": ""}) for k, v in sd.items()}
    refdcp.load(out, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner())
    dist.barrier()
    return all(
        torch.equal(out[k].cpu(), v.cpu()) if isinstance(v, torch.Tensor) else out[k] == v for k, v in sd.items()
    )
