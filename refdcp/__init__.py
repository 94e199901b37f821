"""refdcp: a formally specified reference implementation of PyTorch Distributed Checkpoint.

``import refdcp as dcp`` is a drop-in for torch DCP's common calls
(``save``, ``load``, ``async_save``) and exports refdcp's planners, storage
and stagers, each an implementation of torch's ABC of the same role.
See ``spec/`` for the requirements every name here is held to.
"""

from refdcp import torch_names as _torch_names
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

_torch_names.install()  # refdcp.state_dict_saver, refdcp.metadata, ... (API-27)


def __getattr__(name: str) -> object:
    """torch's top-level DCP names and submodules that refdcp does not define itself (API-27)."""
    if name in _torch_names.SUBMODULES or name in _torch_names.WHOLE:
        import importlib

        return importlib.import_module(f"refdcp.{name}")
    return _torch_names.resolve("", name, _torch_names.TOP_LEVEL)


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
