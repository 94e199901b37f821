"""refdcp storage: filesystem (torch layout + atomic commit + checksums) and in-memory."""

from refdcp.storage.errors import (
    CheckpointExistsError,
    CorruptionError,
    FormatVersionError,
    MissingChecksumError,
    UnsafeMetadataError,
)
from refdcp.storage.filesystem import FileSystemReader, FileSystemWriter
from refdcp.storage.memory import MemoryReader, MemoryStorage, MemoryWriter
from refdcp.storage.verify import VerifyReport, verify_checkpoint

__all__ = [
    "CheckpointExistsError",
    "CorruptionError",
    "FileSystemReader",
    "FileSystemWriter",
    "FormatVersionError",
    "MemoryReader",
    "MemoryStorage",
    "MemoryWriter",
    "MissingChecksumError",
    "UnsafeMetadataError",
    "VerifyReport",
    "verify_checkpoint",
]
