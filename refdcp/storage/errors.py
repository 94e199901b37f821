"""Errors raised by refdcp's storage layer (spec/storage.md)."""

from __future__ import annotations

import pickle

from refdcp.errors import RefdcpError

__all__ = [
    "CheckpointExistsError",
    "ConcurrentSaveError",
    "CorruptionError",
    "FormatVersionError",
    "MissingChecksumError",
    "MalformedMetadataError",
    "MetadataFieldMissing",
    "MetadataUnreadableError",
    "UnsafeMetadataError",
    "UnsafeObjectError",
    "UnsafePathError",
]


class CorruptionError(RefdcpError):
    """Stored bytes do not match their checksum or framing (INTEG-3).

    ``fqn``, ``file`` and ``offset`` locate the damaged item (``fqn`` is None
    for damage to ``.metadata`` itself). ``overwritten`` names the keys whose
    destinations this rank's load had already given checkpoint values when it
    failed (LOAD-20); empty where nothing was delivered or it is not known.
    """

    def __init__(self, message: str, *, fqn: str | None, file: str, offset: int) -> None:
        where = f"fqn={fqn!r}, " if fqn is not None else ""
        super().__init__(f"{message} ({where}file={file!r}, offset={offset})")
        self.fqn = fqn
        self.file = file
        self.offset = offset
        self.overwritten: tuple[str, ...] = ()

    def name_overwritten(self, keys: list[str]) -> None:
        """Record and state the keys already overwritten on this rank (LOAD-20)."""
        unique = tuple(dict.fromkeys(keys))
        self.overwritten = unique
        shown = ", ".join(repr(k) for k in unique[:10])
        more = f" and {len(unique) - 10} more" if len(unique) > 10 else ""
        said = f"{shown}{more}" if unique else "none"
        self.args = (f"{self.args[0]}; keys already overwritten on this rank: {said}",)

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_corruption,
            (self.args[0], self.fqn, self.file, self.offset, self.overwritten),
        )


def _rebuild_corruption(
    message: str, fqn: str | None, file: str, offset: int, overwritten: tuple[str, ...] = ()
) -> CorruptionError:
    err = CorruptionError.__new__(CorruptionError)
    RefdcpError.__init__(err, message)
    err.fqn, err.file, err.offset, err.overwritten = fqn, file, offset, overwritten
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


class CheckpointMovedError(RefdcpError):
    """The checkpoint path was re-pointed or renamed during a save, so it does not name
    the directory the save wrote to (STORE-57, STORE-58). Before the commit it fails the save;
    after it, the save is committed where its data is and the message says where."""


class CheckpointReplacedError(RefdcpError):
    """A load's data file was reclaimed by a save that committed a new checkpoint at the
    path while the load ran (LOAD-22): load again to read the new one.

    ``overwritten`` names the keys whose destinations this rank's load had already
    given values of the checkpoint it started from (LOAD-20)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.overwritten: tuple[str, ...] = ()

    def name_overwritten(self, keys: list[str]) -> None:
        """Record and state the keys already overwritten on this rank (LOAD-20)."""
        CorruptionError.name_overwritten(self, keys)  # type: ignore[arg-type]


class UnsafeObjectError(RefdcpError, pickle.UnpicklingError):
    """A saved non-tensor value references a global outside the allow-list (LOAD-9).

    Names the key, the refused class and the option that allows it.
    """

    def __init__(self, fqn: str, refused: str | None, detail: str = "") -> None:
        if refused:
            head = (
                f"{fqn!r}: the saved value references {refused}, which refdcp does not "
                "unpickle by default (naming it imports and may run code). If you trust this "
                f"checkpoint, pass safe_globals=[{refused}] to refdcp.load (or to "
                "DefaultLoadPlanner), or DefaultLoadPlanner(allow_pickle=True)"
            )
        else:
            head = (
                f"{fqn!r}: the saved value cannot be rebuilt by the weights-only unpickler "
                f"({detail or 'unsupported pickle content'}). If you trust this checkpoint, "
                "load it with DefaultLoadPlanner(allow_pickle=True)"
            )
        super().__init__(head + " (LOAD-9)")
        self.fqn = fqn
        self.refused = refused
        self.detail = detail

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.fqn, self.refused, self.detail))


class MetadataUnreadableError(RefdcpError):
    """``.metadata`` exists but cannot be read; nothing could be verified (TOOL-13)."""


class MetadataFieldMissing(RefdcpError):
    """The vectorised ``.metadata`` check met an entry without a required field (internal:
    ``storage/metadata/bulk.py`` catches it and leaves that entry to the per-item check)."""


class TransformUnavailableError(RefdcpError, ValueError):
    """A stream transform cannot be applied here: its package is missing or its descriptor
    names no registered extension (FMT-25). The message names the package to install."""
