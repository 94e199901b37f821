"""``save`` and ``load`` on the reference path (REF-1): the same protocol, the plain pieces.

Both drive the protocol machines (``refdcp.protocol``: SAVE and LOAD, one row per
transition) through the same driver and communicators as ``refdcp.save`` and
``refdcp.load`` (PROTO-2, ERR-1), with the reference planners and filesystem
storage by default. Any torch planner or storage may be passed instead (API-3).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.comm import Communicator, SingleRank, TorchDistComm
from refdcp.driver import LoadContext, SaveContext, drive
from refdcp.driver.run import FaultHook
from refdcp.errors import CheckpointError
from refdcp.protocol import LOAD, SAVE

from .load_planner import ReferenceLoadPlanner
from .save_planner import ReferenceSavePlanner
from .storage import ReferenceReader, ReferenceWriter

__all__ = ["load", "save"]


def _comm(comm: Communicator | None) -> Communicator:
    """The given communicator, else the default process group, else one rank (API-4)."""
    if comm is not None:
        return comm
    if dist.is_available() and dist.is_initialized():
        return TorchDistComm()
    return SingleRank()


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    comm: Communicator | None = None,
    fault: FaultHook | None = None,
) -> Metadata:
    """Save ``state_dict`` collectively; every rank returns the committed Metadata (API-1).
    ``fault(i, action)`` runs before this rank's i-th action and may raise (PROTO-7)."""
    c = _comm(comm)
    if storage_writer is None and checkpoint_id is None:
        raise ValueError("`checkpoint_id` must be given when no storage_writer is given (API-5)")
    ctx = SaveContext(
        rank=c.rank,
        world_size=c.world_size,
        coordinator=c.rank == c.coordinator_rank,
        state_dict=state_dict,
        writer=storage_writer or ReferenceWriter(checkpoint_id),  # type: ignore[arg-type]
        planner=planner or ReferenceSavePlanner(),
    )
    try:
        result: Metadata = drive(SAVE, ctx, c, fault=fault)
        return result
    except BaseException as exc:
        committed = isinstance(exc, CheckpointError) and exc.committed is not False
        abort = getattr(ctx.writer, "abort_save", None)
        if abort is not None and not committed:
            abort()  # a failed save removes what it wrote (STORE-31)
        raise


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    comm: Communicator | None = None,
    verify: bool | None = None,
    fault: FaultHook | None = None,
) -> None:
    """Load into ``state_dict`` in place, resharding as needed (API-1, API-2, API-6)."""
    c = _comm(comm)
    if storage_reader is None and checkpoint_id is None:
        raise ValueError("`checkpoint_id` must be given when no storage_reader is given (API-5)")
    ctx = LoadContext(
        rank=c.rank,
        world_size=c.world_size,
        coordinator=c.rank == c.coordinator_rank,
        state_dict=state_dict,
        reader=storage_reader or ReferenceReader(checkpoint_id),  # type: ignore[arg-type]
        planner=planner or ReferenceLoadPlanner(),
        verify=verify,
    )
    drive(LOAD, ctx, c, fault=fault)
