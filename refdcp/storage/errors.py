"""Errors raised by refdcp's storage layer (spec/storage.md)."""

from __future__ import annotations

from refdcp.errors import RefdcpError

__all__ = [
    "CheckpointExistsError",
    "CorruptionError",
    "FormatVersionError",
    "MissingChecksumError",
    "UnsafeMetadataError",
]


class CorruptionError(RefdcpError):
    """Stored bytes do not match their checksum or framing (INTEG-3).

    ``fqn``, ``file`` and ``offset`` locate the damaged item (``fqn`` is None
    for damage to ``.metadata`` itself).
    """

    def __init__(self, message: str, *, fqn: str | None, file: str, offset: int) -> None:
        where = f"fqn={fqn!r}, " if fqn is not None else ""
        super().__init__(f"{message} ({where}file={file!r}, offset={offset})")
        self.fqn = fqn
        self.file = file
        self.offset = offset

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_corruption, (self.args[0], self.fqn, self.file, self.offset))


def _rebuild_corruption(message: str, fqn: str | None, file: str, offset: int) -> CorruptionError:
    err = CorruptionError.__new__(CorruptionError)
    RefdcpError.__init__(err, message)
    err.fqn, err.file, err.offset = fqn, file, offset
    return err


class UnsafeMetadataError(RefdcpError):
    """``.metadata`` references a global outside the allowlist (FMT-6)."""


class FormatVersionError(RefdcpError):
    """The checkpoint's format version is not one this refdcp reads (FMT-7)."""


class CheckpointExistsError(RefdcpError, FileExistsError):
    """``overwrite=False`` and a committed checkpoint is already at the path (STORE-6)."""


class MissingChecksumError(RefdcpError):
    """verify was requested for an item that has no recorded checksum (INTEG-5)."""
