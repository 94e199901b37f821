"""Staging: snapshots of a state dict that later training steps cannot change (spec/staging.md).

Also carries torch's ``staging`` names (``AsyncStager``, ``BlockingAsyncStager``,
``DefaultStager``, ``StagingOptions``): torch's own, which ``refdcp.async_save``
accepts (API-27).
"""

from __future__ import annotations

from torch.distributed.checkpoint.staging import (
    AsyncStager,
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)

from refdcp.staging.buffer_pool import BufferPool, Lease, StagingTimeoutError
from refdcp.staging.cpu_stager import CpuStager, StagedStateDict
from refdcp.staging.cuda_stager import CudaAsyncStager
from refdcp.staging.machine import Action, Event, State

__all__ = [
    "Action",
    "AsyncStager",
    "BlockingAsyncStager",
    "BufferPool",
    "CpuStager",
    "CudaAsyncStager",
    "DefaultStager",
    "Event",
    "Lease",
    "StagedStateDict",
    "StagingOptions",
    "StagingTimeoutError",
    "State",
]
