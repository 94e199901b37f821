"""refdcp storage: filesystem (torch layout + atomic commit + checksums) and in-memory.

Also carries torch's ``storage`` names (``StorageWriter``, ``StorageReader``,
``WriteResult``: the ABCs and the record refdcp uses as they are, API-27).
"""

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from refdcp.storage.errors import (
    CheckpointExistsError,
    CheckpointMovedError,
    CheckpointReplacedError,
    ConcurrentSaveError,
    CorruptionError,
    FormatVersionError,
    MalformedMetadataError,
    MetadataUnreadableError,
    MissingChecksumError,
    UnsafeMetadataError,
    UnsafeObjectError,
    UnsafePathError,
)
from refdcp.storage.fs.filesystem import FileSystemReader, FileSystemWriter
from refdcp.storage.memory import MemoryReader, MemoryStorage, MemoryWriter
from refdcp.storage.metadata.limits import MetadataLimits, set_metadata_limits
from refdcp.storage.verify import VerifyReport, verify_checkpoint

__all__ = [
    "CheckpointExistsError",
    "CheckpointMovedError",
    "CheckpointReplacedError",
    "ConcurrentSaveError",
    "CorruptionError",
    "FileSystemReader",
    "FileSystemWriter",
    "FormatVersionError",
    "MalformedMetadataError",
    "MemoryReader",
    "MemoryStorage",
    "MemoryWriter",
    "MetadataLimits",
    "MetadataUnreadableError",
    "MissingChecksumError",
    "StorageReader",
    "StorageWriter",
    "UnsafeMetadataError",
    "UnsafeObjectError",
    "UnsafePathError",
    "WriteResult",
    "VerifyReport",
    "set_metadata_limits",
    "verify_checkpoint",
]
