"""Staging: snapshots of a state dict that later training steps cannot change (spec/staging.md)."""

from __future__ import annotations

from refdcp.staging.buffer_pool import BufferPool, Lease, StagingTimeoutError
from refdcp.staging.cpu_stager import CpuStager, StagedStateDict
from refdcp.staging.cuda_stager import CudaAsyncStager
from refdcp.staging.machine import Action, Event, State

__all__ = [
    "Action",
    "BufferPool",
    "CpuStager",
    "CudaAsyncStager",
    "Event",
    "Lease",
    "StagedStateDict",
    "StagingTimeoutError",
    "State",
]
