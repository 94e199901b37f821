"""Offline verification of a checkpoint's checksums (INTEG-6, INTEG-7), in bounded memory (INTEG-10)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from refdcp.crc.kernel import crc32c
from refdcp.storage.errors import (
    CheckpointReplacedError,
    CorruptionError,
    FormatVersionError,
    MetadataUnreadableError,
    UnsafeMetadataError,
    UnsafePathError,
)
from refdcp.storage.format import layout
from refdcp.storage.format.items import checksum_of
from refdcp.storage.fs.metadata_file import metadata_identity, read_metadata_file_stat
from refdcp.storage.fs.paths import open_data_file, pread_exact
from refdcp.storage.metadata.safe import load_metadata
from refdcp.storage.metadata.stored_layout import record_problem, storage_records, tiling_problem

__all__ = [
    "MetadataUnreadableError",
    "Problem",
    "VerifyReport",
    "verify_checkpoint",
    "verify_files",
    "verify_ranges",
]


@dataclass(frozen=True)
class Problem:
    """One defect: which item (None: the metadata), which file, which byte offset."""

    fqn: str | None
    file: str
    offset: int
    message: str


@dataclass
class VerifyReport:
    """Outcome of ``verify_checkpoint``; ``ok`` is True only with no problems."""

    path: str
    items_checked: int = 0
    items_without_checksum: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "items_checked": self.items_checked,
            "items_without_checksum": self.items_without_checksum,
            "problems": [p.__dict__ for p in self.problems],
        }


#: ``read_range(name, offset, length)``: up to ``length`` bytes of file ``name`` at
#: ``offset``; None when the file does not exist. Raises OSError when it cannot be
#: read and UnsafePathError for a name or file refdcp refuses to read.
ReadRange = Callable[[str, int, int], bytes | None]


def verify_files(
    metadata_bytes: bytes | None, read_file: Callable[[str], bytes | None], path: str
) -> VerifyReport:
    """Verify a checkpoint given its metadata bytes and a whole-file reader (INTEG-6)."""

    def read_range(name: str, offset: int, length: int) -> bytes | None:
        data = read_file(name)
        return None if data is None else bytes(memoryview(data)[offset : offset + length])

    return verify_ranges(metadata_bytes, read_range, path)


def verify_ranges(metadata_bytes: bytes | None, read_range: ReadRange, path: str) -> VerifyReport:
    """Verify a checkpoint reading each item's byte range only, in pieces (INTEG-6, INTEG-10, STORE-28)."""
    report = VerifyReport(path)
    if metadata_bytes is None:
        report.problems.append(
            Problem(None, layout.METADATA_NAME, 0, "no .metadata: not committed")
        )
        return report
    try:
        metadata = load_metadata(metadata_bytes, file=layout.METADATA_NAME)
    except CorruptionError as exc:
        report.problems.append(Problem(None, exc.file, exc.offset, str(exc)))
        return report
    except (UnsafeMetadataError, FormatVersionError) as exc:
        report.problems.append(Problem(None, layout.METADATA_NAME, 0, str(exc)))
        return report
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    located = {(k.fqn, tuple(k.offset) if k.offset is not None else None) for k in storage}
    located_fqns = {k.fqn for k in storage}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            missing = any((fqn, tuple(c.offsets)) not in located for c in md.chunks)
        else:
            missing = fqn not in located_fqns
        if missing:
            report.problems.append(Problem(fqn, layout.METADATA_NAME, 0, "no storage location"))
    report.problems += layout_problems(metadata)  # FMT-28, FMT-29
    bad_files: dict[str, str] = {}
    for index, info in sorted(storage.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        name = info.relative_path
        if name in bad_files:
            report.problems.append(Problem(index.fqn, name, info.offset, bad_files[name]))
            continue
        expected = checksum_of(info)
        try:
            # an item without a checksum is only looked for: nothing to compare its bytes with
            got = _stream_crc(
                read_range, name, info.offset, info.length if expected is not None else 0
            )
        except UnsafePathError as exc:
            bad_files[name] = str(exc)
            report.problems.append(Problem(index.fqn, name, info.offset, str(exc)))
            continue
        except OSError as exc:
            bad_files[name] = f"data file cannot be read: {exc.strerror or exc}"
            report.problems.append(Problem(index.fqn, name, info.offset, bad_files[name]))
            continue
        if got is None:
            bad_files[name] = "data file missing"
            report.problems.append(Problem(index.fqn, name, info.offset, "data file missing"))
            continue
        crc, n = got
        if expected is None:
            report.items_without_checksum += 1
        elif n != info.length:
            message = f"item truncated: {n} of {info.length} bytes"
            report.problems.append(Problem(index.fqn, name, info.offset, message))
        elif crc != expected:
            message = f"checksum mismatch (stored {expected:08x}, computed {crc:08x})"
            report.problems.append(Problem(index.fqn, name, info.offset, message))
        else:
            report.items_checked += 1
    return report


def layout_problems(metadata: Metadata) -> list[Problem]:
    """The stored-layout rules over every key: chunks that do not tile their tensor
    (FMT-28) and records that share bytes of a file (FMT-29)."""
    out = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            problem = tiling_problem(md.size, md.chunks)
            if problem is not None:
                message = f"the stored chunks do not tile the tensor: {problem}"
                out.append(Problem(fqn, layout.METADATA_NAME, 0, message))
    shared = record_problem(storage_records(metadata))
    if shared is not None:
        out.append(Problem(None, layout.METADATA_NAME, 0, shared))
    return out


#: bytes of an item read and checksummed at a time: memory stays bounded however large
#: the item (INTEG-10)
PIECE_BYTES = 8 << 20


def _stream_crc(
    read_range: ReadRange, name: str, offset: int, length: int
) -> tuple[int, int] | None:
    """(CRC-32C, bytes read) of up to ``length`` bytes of ``name`` at ``offset``, read in
    pieces of at most ``PIECE_BYTES`` (INTEG-10); None when the file does not exist."""
    crc = done = 0
    while True:
        want = min(PIECE_BYTES, length - done)
        piece = read_range(name, offset + done, want)
        if piece is None:
            return None
        crc = crc32c(piece, crc)
        done += len(piece)
        if len(piece) < want or done >= length:
            return crc, done


class _FileRanges:
    """Reads item ranges of a checkpoint directory: one open file at a time, regular
    files only, never more than the stated length nor past the file's end (STORE-28)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name: str | None = None
        self.fd: int | None = None
        self.size = 0

    def __call__(self, name: str, offset: int, length: int) -> bytes | None:
        if name != self.name:
            self.close()
            try:
                self.fd = open_data_file(self.root, name)
            except FileNotFoundError:
                return None
            self.name = name
            self.size = os.fstat(self.fd).st_size
        assert self.fd is not None
        if offset >= self.size:
            return b""
        return pread_exact(self.fd, min(length, self.size - offset), offset)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.name = None, None


#: checks of one path in a row that a concurrent save may replace before
#: ``verify_checkpoint`` gives up (INTEG-14)
ATTEMPTS = 3


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Verify every checksum of the filesystem checkpoint at ``path`` (INTEG-6).

    A ``.metadata`` that exists but cannot be read (permission, not a regular
    file, over the size limit) raises ``MetadataUnreadableError`` naming the
    file and the cause; a missing one is reported as "not committed" (TOOL-13).
    The verdict is about one committed checkpoint: when a save replaced the
    ``.metadata`` while it was checked, the check starts again from the new one,
    and after ``ATTEMPTS`` replacements in a row ``CheckpointReplacedError`` is
    raised (INTEG-14).
    """
    root = Path(path)
    if not root.is_dir():
        raise MetadataUnreadableError(f"{root}: not a checkpoint directory")
    meta_path = root / layout.METADATA_NAME
    for _ in range(ATTEMPTS):
        metadata_bytes, read = _read_committed(meta_path)
        ranges = _FileRanges(root)
        try:
            report = verify_ranges(metadata_bytes, ranges, str(root))
        finally:
            ranges.close()
        if _identity_now(meta_path) == read:
            return report
    raise CheckpointReplacedError(
        f"{meta_path}: the checkpoint was replaced while verifying it, {ATTEMPTS} times in a "
        "row (saves are committing into this directory); no verdict: verify again when "
        "they stop"
    )


def _read_committed(meta_path: Path) -> tuple[bytes | None, tuple[int, ...] | None]:
    """The committed ``.metadata``'s bytes and identity; (None, None) when there is none."""
    try:
        data, st = read_metadata_file_stat(meta_path)
    except FileNotFoundError:
        return None, None
    except UnsafeMetadataError as exc:
        raise MetadataUnreadableError(str(exc)) from exc
    except OSError as exc:
        raise MetadataUnreadableError(
            f"{meta_path}: cannot be read: {exc.strerror or exc}"
        ) from exc
    return data, metadata_identity(st)


def _identity_now(meta_path: Path) -> tuple[int, ...] | None:
    try:
        return metadata_identity(os.stat(meta_path, follow_symlinks=False))
    except FileNotFoundError:
        return None
