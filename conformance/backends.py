"""Ready-made backends: refdcp's storage and torch's writers/readers (CONF-43).

Use them as targets: ``refdcp conformance conformance.backends:refdcp_fs``.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader as TorchFSReader
from torch.distributed.checkpoint.filesystem import FileSystemWriter as TorchFSWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from conformance.backend import Capabilities
from conformance.profiles import SAFETENSORS

__all__ = [
    "RefdcpFileSystem",
    "RefdcpMemory",
    "TorchFileSystem",
    "TorchFsspec",
    "TorchHuggingFace",
    "refdcp_fs",
    "refdcp_memory",
    "torch_fs",
    "torch_fs_synced",
    "torch_fsspec_file",
    "torch_fsspec_memory",
    "torch_hf",
]


@dataclass
class RefdcpFileSystem:
    """refdcp's FileSystemWriter/Reader, with ``sync_files=True`` (its default), as the
    power-loss checks need (CONF-58..60)."""

    name: str = "refdcp FileSystemWriter/FileSystemReader"
    capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(atomic_overwrite=True, thread_count=True)
    )

    def new_location(self, scratch: Path) -> Any:
        return str(scratch / "ckpt")

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        from refdcp.storage import FileSystemWriter

        return FileSystemWriter(location, sync_files=True, thread_count=thread_count)

    def reader(self, location: Any) -> StorageReader:
        from refdcp.storage import FileSystemReader

        return FileSystemReader(location)


@dataclass
class RefdcpMemory:
    """refdcp's MemoryStorage; one storage shared by every location of a run."""

    name: str = "refdcp MemoryStorage"
    capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(atomic_overwrite=True, process_async=False)
    )
    _counter: Any = field(default_factory=itertools.count)
    _storage: Any = None

    def _store(self) -> Any:
        if self._storage is None:
            from refdcp.storage import MemoryStorage

            self._storage = MemoryStorage()
        return self._storage

    def new_location(self, scratch: Path) -> Any:
        return f"ckpt-{next(self._counter)}"

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        writer: StorageWriter = self._store().writer(location)
        return writer

    def reader(self, location: Any) -> StorageReader:
        reader: StorageReader = self._store().reader(location)
        return reader


@dataclass
class TorchFileSystem:
    """torch 2.13's FileSystemWriter/FileSystemReader, with ``sync_files`` as given."""

    name: str = ""
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(thread_count=True))
    sync_files: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"torch FileSystemWriter/FileSystemReader (sync_files={self.sync_files})"

    def new_location(self, scratch: Path) -> Any:
        return str(scratch / "ckpt")

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        return TorchFSWriter(location, sync_files=self.sync_files, thread_count=thread_count)

    def reader(self, location: Any) -> StorageReader:
        return TorchFSReader(location)


@dataclass
class TorchFsspec:
    """torch 2.13's FsspecWriter/FsspecReader over ``file://`` or ``memory://``."""

    protocol: str = "file"
    name: str = ""
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(thread_count=True))
    _counter: Any = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"torch FsspecWriter/FsspecReader ({self.protocol}://)"
        if self.protocol == "memory":
            # memory:// is per process: a pickled writer in a spawned process saves elsewhere
            self.capabilities = replace(self.capabilities, process_async=False)

    def new_location(self, scratch: Path) -> Any:
        if self.protocol == "file":
            return f"file://{scratch / 'ckpt'}"
        # a fresh name per location: id(self) is reused once an earlier backend is freed, and
        # the memory filesystem is process-wide, so a reused id met the old one's files
        return f"memory://refdcp-conformance/{uuid.uuid4().hex}/{next(self._counter)}"

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(location, sync_files=False, thread_count=thread_count)

    def reader(self, location: Any) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(location)


def refdcp_fs() -> RefdcpFileSystem:
    return RefdcpFileSystem()


def refdcp_memory() -> RefdcpMemory:
    return RefdcpMemory()


def torch_fs() -> TorchFileSystem:
    return TorchFileSystem()


def torch_fs_synced() -> TorchFileSystem:
    return TorchFileSystem(sync_files=True)


def torch_fsspec_file() -> TorchFsspec:
    return TorchFsspec("file")


def torch_fsspec_memory() -> TorchFsspec:
    return TorchFsspec("memory")


@dataclass
class TorchHuggingFace:
    """torch's ``HuggingFaceStorageWriter(save_distributed=True)``/``HuggingFaceStorageReader``
    on a local directory, under the safetensors profile (CONF-69): every rank writes its
    own ``shard-NNNNN-...safetensors`` file, so ranks share a location."""

    name: str = "torch HuggingFaceStorageWriter(save_distributed=True)/HuggingFaceStorageReader"
    capabilities: Capabilities = field(
        default_factory=lambda: dataclasses.replace(SAFETENSORS, thread_count=True)
    )

    def new_location(self, scratch: Path) -> Any:
        return str(scratch / "ckpt")

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        return HuggingFaceStorageWriter(location, save_distributed=True, thread_count=thread_count)

    def reader(self, location: Any) -> StorageReader:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

        return HuggingFaceStorageReader(location)


def torch_hf() -> TorchHuggingFace:
    return TorchHuggingFace()
