"""refdcp: a formally specified reference implementation of PyTorch Distributed Checkpoint.

``import refdcp as dcp`` is a drop-in for torch DCP's common calls
(``save``, ``load``, ``async_save``) and exports refdcp's planners, storage
and stagers, each an implementation of torch's ABC of the same role.
See ``spec/`` for the requirements every name here is held to.
"""

from refdcp.api import load, save
from refdcp.asyncsave.checkpointer import Checkpointer
from refdcp.asyncsave.default_stager import release_staging_buffers
from refdcp.asyncsave.save import AsyncSaveHandle, async_save
from refdcp.errors import (
    CheckpointError,
    CommAborted,
    CommError,
    CommTimeout,
    ProtocolError,
    RefdcpError,
)
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner, LoadPolicy, LocalShards
from refdcp.staging import BufferPool, CpuStager, CudaAsyncStager
from refdcp.state.app_state import AppState
from refdcp.storage import (
    CorruptionError,
    FileSystemReader,
    FileSystemWriter,
    MemoryStorage,
    verify_checkpoint,
)

__version__ = "0.1.0"

__all__ = [
    "AppState",
    "AsyncSaveHandle",
    "BufferPool",
    "CheckpointError",
    "Checkpointer",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "CorruptionError",
    "CpuStager",
    "CudaAsyncStager",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "LoadPolicy",
    "LocalShards",
    "MemoryStorage",
    "ProtocolError",
    "RefdcpError",
    "async_save",
    "load",
    "release_staging_buffers",
    "save",
    "verify_checkpoint",
]
