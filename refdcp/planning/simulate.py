"""Run planners for N simulated ranks in one process over an in-memory store.

Teaching and testing aid: it drives any ``SavePlanner``/``LoadPlanner``
(refdcp's or torch's) through torch's call order, with a dict as storage, no
process group and no files (spec/planning.md, RESHARD-4, PLAN-8).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)

__all__ = ["MemoryCheckpoint", "simulate_load", "simulate_save"]


@dataclass
class MemoryCheckpoint:
    """Metadata plus the stored chunks (tensors) and objects (bytes) by MetadataIndex."""

    metadata: Metadata
    data: dict[MetadataIndex, torch.Tensor | bytes] = field(default_factory=dict)
    writers: dict[MetadataIndex, int] = field(default_factory=dict)
    plans: list[SavePlan] = field(default_factory=list)


def simulate_save(
    state_dicts: Sequence[dict[str, Any]],
    planner_factory: Callable[[], SavePlanner],
    coordinator: int = 0,
) -> MemoryCheckpoint:
    """Plan and 'write' a save of one state dict per rank."""
    planners = [planner_factory() for _ in state_dicts]
    for rank, (p, sd) in enumerate(zip(planners, state_dicts)):
        p.set_up_planner(sd, None, rank == coordinator)
    local = [p.create_local_plan() for p in planners]
    plans, metadata = planners[coordinator].create_global_plan(local)
    ckpt = MemoryCheckpoint(metadata=metadata, plans=list(plans))
    for rank, (p, plan) in enumerate(zip(planners, plans)):
        final = p.finish_plan(plan)
        for item in final.items:
            value = p.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(value, io.BytesIO)
                stored: torch.Tensor | bytes = value.getvalue()
            else:
                assert isinstance(value, torch.Tensor)
                stored = value.detach().to("cpu").clone(memory_format=torch.contiguous_format)
            if item.index in ckpt.data:
                raise AssertionError(
                    f"{item.index} written twice (ranks {ckpt.writers[item.index]}, {rank})"
                )
            ckpt.data[item.index] = stored
            ckpt.writers[item.index] = rank
    return ckpt


def simulate_load(
    state_dicts: Sequence[dict[str, Any]],
    ckpt: MemoryCheckpoint,
    planner_factory: Callable[[], LoadPlanner],
    coordinator: int = 0,
) -> list[int]:
    """Plan and perform a load into one state dict per rank; returns each rank's read count."""
    planners = [planner_factory() for _ in state_dicts]
    for rank, (p, sd) in enumerate(zip(planners, state_dicts)):
        p.set_up_planner(sd, ckpt.metadata, rank == coordinator)
    local = [p.create_local_plan() for p in planners]
    plans = planners[coordinator].create_global_plan(local)
    counts = []
    for p, plan in zip(planners, plans):
        final = p.finish_plan(plan)
        for item in final.items:
            stored = ckpt.data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                assert isinstance(stored, bytes)
                p.load_bytes(item, io.BytesIO(stored))
                continue
            assert isinstance(stored, torch.Tensor)
            src = stored
            for d, (off, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(d, off, n)
            dst = p.resolve_tensor(item)
            if dst.shape != src.shape:
                raise AssertionError(f"read {item} has shape {src.shape} into {dst.shape}")
            dst.copy_(src)
            p.commit_tensor(item, dst)
        counts.append(len(final.items))
    return counts
