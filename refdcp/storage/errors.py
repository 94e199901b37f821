"""Errors raised by refdcp's storage layer (spec/storage.md)."""

from __future__ import annotations

from refdcp.errors import RefdcpError

__all__ = [
    "CheckpointExistsError",
    "ConcurrentSaveError",
    "CorruptionError",
    "FormatVersionError",
    "MissingChecksumError",
    "MalformedMetadataError",
    "UnsafeMetadataError",
    "UnsafePathError",
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


class MalformedMetadataError(CorruptionError):
    """``.metadata`` unpickled, but a field has the wrong type or exceeds a limit (FMT-9, FMT-10).

    ``field`` is the dotted path of the offending field, e.g.
    ``state_dict_metadata['w'].chunks[0].sizes``.
    """

    def __init__(self, message: str, *, field: str, file: str) -> None:
        super().__init__(f"{field}: {message}", fqn=None, file=file, offset=0)
        self.field = field

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_malformed, (self.args[0], self.field, self.file))


def _rebuild_malformed(message: str, field: str, file: str) -> MalformedMetadataError:
    err = MalformedMetadataError.__new__(MalformedMetadataError)
    RefdcpError.__init__(err, message)
    err.fqn, err.file, err.offset, err.field = None, file, 0, field
    return err


class UnsafePathError(UnsafeMetadataError):
    """A data-file name from ``.metadata`` is not a plain name of a regular file
    inside the checkpoint directory (STORE-26, STORE-27), or a file refdcp opens in
    the directory (a lock file) is a symbolic link or not a regular file (STORE-56)."""


class ConcurrentSaveError(RefdcpError):
    """Another save into the same checkpoint path holds its lock (STORE-29)."""
